"""Export a training checkpoint as a Hugging Face model folder (`python -m falcon_lab.export`).

The folder holds `config.json` (FalconLabConfig: the model and mixer config, the training length, the
special ids, provenance), `model.safetensors` (the decoder's weights under the checkpoint's own names),
`generation_config.json`, `tokenizer.json` + `tokenizer_config.json` (falcon_lab/hf/tokenizer.py), two
three-line files that let `trust_remote_code=True` load it in a process that never imported falcon_lab
(the package must be installed), and a short README.md. Before anything is written the tokenizer is checked
against the platform's; after, the folder is loaded back and its logits compared with the checkpoint's.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

REMOTE_FILES = {
    "configuration_falcon_lab.py": '"""Written by python -m falcon_lab.export: the class is falcon_lab\'s own (pip install falcon_lab)."""\n'
                                   "from falcon_lab.hf.configuration import FalconLabConfig  # noqa: F401\n",
    "modeling_falcon_lab.py": '"""Written by python -m falcon_lab.export: the class is falcon_lab\'s own (pip install falcon_lab)."""\n'
                              "from falcon_lab.hf.modeling import FalconLabForCausalLM  # noqa: F401\n",
}
AUTO_MAP = {"AutoConfig": "configuration_falcon_lab.FalconLabConfig",
            "AutoModelForCausalLM": "modeling_falcon_lab.FalconLabForCausalLM"}
DTYPES = (None, "float32", "bfloat16", "float16")


class ExportError(ValueError):
    pass


def _train_len(cfg) -> int:
    try:
        return int(cfg.data.seq_len)
    except Exception:
        return 2048


def hf_config_for(model, tok, cfg, source: str | None = None):
    """FalconLabConfig for a platform Decoder `model` built from training config `cfg`, tokenizer `tok`."""
    from omegaconf import OmegaConf

    from falcon_lab.hf.configuration import FalconLabConfig

    train = OmegaConf.to_container(cfg, resolve=False) if cfg is not None else None
    try:
        tok_name = str(tok.state().get("name"))
    except Exception:
        tok_name = type(tok).__name__
    meta = {"source_checkpoint": source, "tokenizer": tok_name, "train_config": train}
    try:
        from falcon_lab import __version__
        meta["falcon_lab_version"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return FalconLabConfig.from_platform(cfg.model, cfg.mixer, model.vocab_size, logit_scale=model.logit_scale,
                                         max_position_embeddings=_train_len(cfg), bos_token_id=int(tok.bos_id),
                                         eos_token_id=int(tok.eos_id), pad_token_id=int(tok.pad_id), falcon_lab=meta)


def wrap(model, config):
    """The platform Decoder `model` (weights kept, not copied) inside a FalconLabForCausalLM."""
    from falcon_lab.hf.modeling import FalconLabForCausalLM

    with torch.device("meta"):
        hf = FalconLabForCausalLM(config)
    hf.model = model
    return hf.eval()


def export_checkpoint(ckpt, out, dtype: str | None = None, overwrite: bool = False, verify: bool = True,
                      remote_code: bool = True) -> Path:
    """Write the Hugging Face folder `out` for training checkpoint `ckpt`. Returns `out`."""
    from falcon_lab.hf.tokenizer import check_tokenizer, export_tokenizer, hf_tokenizer
    from falcon_lab.training import load_checkpoint

    if dtype not in DTYPES:
        raise ExportError(f"dtype: {dtype!r} is not one of null, float32, bfloat16, float16")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ExportError(f"out: {str(out)!r} exists and is not an empty folder (overwrite=true replaces it)")
        if not out.is_dir() or not (out / "config.json").is_file():
            raise ExportError(f"out: {str(out)!r} is not a model folder written by an export; refusing to replace it")
    model, tok, cfg = load_checkpoint(str(ckpt), map_location="cpu")
    config = hf_config_for(model, tok, cfg, source=str(Path(ckpt).resolve()))
    check_tokenizer(hf_tokenizer(tok, config.max_position_embeddings), tok)  # before anything is written
    if dtype:
        model = model.to(getattr(torch, dtype))
    hf = wrap(model, config)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf.save_pretrained(str(out))
    export_tokenizer(tok, out, model_max_length=config.max_position_embeddings)
    if remote_code:
        for name, text in REMOTE_FILES.items():
            (out / name).write_text(text)
        cj = json.loads((out / "config.json").read_text())
        cj["auto_map"] = AUTO_MAP
        (out / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(_card(config, ckpt))
    if verify:
        verify_export(out, model, tok)
    return out


def verify_export(out, model, tok, text: str = "In the beginning God created the heaven and the earth.") -> float:
    """Load `out` back through transformers' AutoModelForCausalLM (as users will) and compare its logits with
    the platform model's on `text`; raise ExportError if they differ beyond float rounding. Returns the largest
    difference."""
    from transformers import AutoModelForCausalLM

    from falcon_lab.hf.modeling import FalconLabForCausalLM

    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    if not isinstance(back, FalconLabForCausalLM):
        raise ExportError(f"verify: AutoModelForCausalLM loaded a {type(back).__name__}, not FalconLabForCausalLM")
    ids = torch.tensor([[tok.bos_id] + tok.encode(text)])
    p = next(model.parameters())
    with torch.no_grad():
        want = model(ids.to(p.device)).float().cpu()
        got = back(ids.to(back.device)).logits.float().cpu()
    diff = float((want - got).abs().max())
    tol = 1e-5 if p.dtype == torch.float32 else 2e-2 * float(want.abs().max())
    if not diff <= tol:
        raise ExportError(f"verify: the exported folder's logits differ from the checkpoint's by {diff:.3g} "
                          f"(tolerance {tol:.3g})")
    return diff


def _card(config, ckpt) -> str:
    mixer = ", ".join(f"{k}={v}" for k, v in config.mixer.items() if v is not None)
    return (f"# falcon_lab model\n\nExported by `python -m falcon_lab.export` from `{os.path.basename(str(ckpt))}`.\n\n"
            f"- mixer: {mixer}\n- {config.n_layers} layers x {config.d_model}, {config.n_heads} heads x {config.head_dim}, "
            f"vocabulary {config.vocab_size}, trained at {config.max_position_embeddings} tokens\n\n"
            "```python\nimport falcon_lab  # registers model_type falcon_lab with transformers' Auto classes\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(PATH)\ntok = AutoTokenizer.from_pretrained(PATH)\n```\n\n"
            "Without importing falcon_lab (it must be installed): `from_pretrained(PATH, trust_remote_code=True)`; "
            "lm-eval: `lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True`.\n")
