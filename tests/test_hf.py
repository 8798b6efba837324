"""falcon_lab models in the Hugging Face ecosystem (issue 20): export a checkpoint, load it with the Auto
classes, same logits as the checkpoint, generate() with the recurrent state / KV cache gives the platform's
greedy tokens, lm-eval's own `hf` model scores as the platform's adapter, tokenizers round-trip, and the
fla-shaped FalconAttention layer equals the platform's mixer. Tiny models, CPU, offline."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF caches (remote-code modules, datasets) in a temporary folder, offline."""
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as mp:  # the variables are put back afterwards
        for k, v in (("HF_HOME", home), ("HF_DATASETS_CACHE", home / "datasets"), ("HF_MODULES_CACHE", home / "mod")):
            mp.setenv(k, str(v))
        yield home


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real checkpoint: the default tiny Falcon-1A.3 trained for a few steps on the embedded corpus."""
    from falcon_lab.training import compose, run
    d = tmp_path_factory.mktemp("trained")
    precision = torch.get_float32_matmul_precision()  # training sets cfg.matmul_precision: put it back after
    cfg = compose(["trainer.max_steps=4", "data.seq_len=32", "data.batch_size=4", "logger=none",
                   "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
                   "checks.n_sentences=2", "optim.lr=3e-3", f"run_dir={d / 'run'}"])
    try:
        return run(cfg)["last_ckpt_path"]
    finally:
        torch.set_float32_matmul_precision(precision)


def make_ckpt(path, overrides, tokenizer=None):
    """A checkpoint in the training format (LitLM's state dict and hyper-parameters) without training; a larger
    init_std so that an untrained tiny model's greedy continuations are not one repeated token."""
    from omegaconf import OmegaConf

    from falcon_lab.data.tokenizer import ByteTokenizer
    from falcon_lab.training import compose
    from falcon_lab.training.module import LitLM
    tok = tokenizer or ByteTokenizer()
    cfg = OmegaConf.to_container(compose(["data.seq_len=32", "model.init_std=0.3"] + list(overrides)), resolve=True)
    torch.manual_seed(1)
    lit = LitLM(cfg, tok.vocab_size, tok.state())
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams)}, path)
    return str(path)


def platform_greedy(model, ids, n, eos_id):
    """The platform's own generate path (prefill, then one recurrent step per token), cut after EOS."""
    out = model.generate(torch.tensor([ids]), n, temperature=0.0, eos_id=eos_id)[0].tolist()
    new = out[len(ids):]
    return new[:new.index(eos_id) + 1] if eos_id in new else new


def hf_new_tokens(row, n_prompt, eos_id, pad_id):
    new = row[n_prompt:]
    if eos_id in new:
        new = new[:new.index(eos_id) + 1]
    return new


# ---------------------------------------------------------------------------------------------------
def test_export_cli_trained_checkpoint_same_logits_and_greedy_tokens(trained, tmp_path, hf_home):
    """python -m falcon_lab.export on a trained checkpoint; AutoModelForCausalLM / AutoTokenizer load the folder;
    logits equal the checkpoint's; generate() gives the platform's greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from falcon_lab.hf import FalconLabForCausalLM
    from falcon_lab.training import load_checkpoint
    out = tmp_path / "exported"
    r = subprocess.run([sys.executable, "-m", "falcon_lab.export", f"ckpt={trained}", f"out={out}"],
                       capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote" in r.stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cj = json.loads((out / "config.json").read_text())
    assert cj["model_type"] == "falcon_lab" and cj["mixer"]["name"] == "falcon" and cj["mixer"]["variant"] == "1A"
    assert cj["max_position_embeddings"] == 32 and cj["falcon_lab"]["tokenizer"] == "byte"

    model, tok, _ = load_checkpoint(trained)
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(hf, FalconLabForCausalLM)
    htok = AutoTokenizer.from_pretrained(str(out))
    text = "And God said, Let there be light"
    ids = htok(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == [tok.bos_id] + tok.encode(text)
    with torch.no_grad():
        want = model(ids)
        got = hf(ids).logits
    assert torch.equal(got, want)

    gen = hf.generate(ids, max_new_tokens=24, do_sample=False)
    new = hf_new_tokens(gen[0].tolist(), ids.shape[1], tok.eos_id, tok.pad_id)
    assert new == platform_greedy(model, ids[0].tolist(), 24, tok.eos_id)


@pytest.mark.parametrize("overrides", [
    ["mixer=falcon", "mixer.variant=3", "mixer.preset=.1", "mixer.window=3"],
    ["mixer=falcon", "mixer.variant=2A", "mixer.lam=const", "mixer.qk_norm_gain=true"],
    ["mixer=attention"],
    ["mixer=retnet"],
], ids=["falcon3_w3", "falcon2A_const", "attention", "retnet"])
def test_variants_export_logits_generate_and_padding(overrides, tmp_path, hf_home):
    """Every mixer family round-trips (knobs, non-persistent buffers); generate() through FalconLabCache equals the
    platform's decoding, also for a left-padded batch (recurrent states stacked, KV caches kept per row)."""
    from transformers import AutoModelForCausalLM

    from falcon_lab.hf import FalconLabCache
    from falcon_lab.hf.export import export_checkpoint
    from falcon_lab.training import load_checkpoint
    ckpt = make_ckpt(tmp_path / "m.ckpt", overrides)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    model, tok, cfg = load_checkpoint(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    for k, v in cfg.mixer.items():
        assert hf.config.mixer[k] == v
    prompts = [[tok.bos_id] + tok.encode("In the beginning"), [tok.bos_id] + tok.encode("Jesus wept.")]
    with torch.no_grad():
        x = torch.tensor([prompts[0]])
        assert torch.equal(hf(x).logits, model(x))
        # a cached forward continues exactly like the platform's prefill + step
        o = hf(x[:, :-1], use_cache=True)
        assert isinstance(o.cache, FalconLabCache) and o.cache.get_seq_length() == x.shape[1] - 1
        o2 = hf(x[:, -1:], cache=o.cache, use_cache=True)
        lg, st = model.prefill(x[:, :-1])
        lg2, _ = model.step(x[:, -1], st)
        assert torch.allclose(o.logits, lg, atol=1e-5) and torch.allclose(o2.logits[:, 0], lg2, atol=1e-5)

    n = 12
    want = [platform_greedy(model, p, n, tok.eos_id) for p in prompts]
    assert hf_new_tokens(hf.generate(torch.tensor([prompts[0]]), max_new_tokens=n, do_sample=False)[0].tolist(),
                         len(prompts[0]), tok.eos_id, tok.pad_id) == want[0]
    assert len(set(want[0] + want[1])) > 2  # continuations, not one repeated token
    # left padding (transformers' convention for decoder-only batches)
    L = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_id] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    gen = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    for row, w in zip(gen.tolist(), want):
        new = hf_new_tokens(row, L, tok.eos_id, tok.pad_id)
        assert new[:len(w)] == w
    # a right-padded batch without a cache (how lm-eval scores) gives each row its own logits
    ids = torch.tensor([p + [tok.pad_id] * (L - len(p)) for p in prompts])
    with torch.no_grad():
        lg = hf(ids).logits
        for r, p in enumerate(prompts):
            assert torch.allclose(lg[r, :len(p)], model(torch.tensor([p]))[0], atol=1e-5)


def test_forward_loss_hidden_states_and_refusals(tmp_path):
    from falcon_lab.hf.export import ExportError, export_checkpoint, hf_config_for, wrap
    from falcon_lab.training import load_checkpoint
    ckpt = make_ckpt(tmp_path / "m.ckpt", [])
    model, tok, cfg = load_checkpoint(ckpt)
    hf = wrap(model, hf_config_for(model, tok, cfg))
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        o = hf(x, labels=x, output_hidden_states=True)
        want = torch.nn.functional.cross_entropy(model(x)[:, :-1].reshape(-1, model.vocab_size), x[:, 1:].reshape(-1))
        assert o.loss.item() == pytest.approx(want.item(), rel=1e-6)
        assert len(o.hidden_states) == cfg.model.n_layers + 1
        assert torch.allclose(model.logits(o.hidden_states[-1]), o.logits, atol=1e-6)
        assert torch.allclose(hf(inputs_embeds=model.embed(x)).logits, o.logits, atol=1e-6)
        assert hf(x, logits_to_keep=1).logits.shape == (2, 1, model.vocab_size)
        # beam search reorders FalconLabCache rows; num_return_sequences repeats them; one beam = greedy
        assert hf.generate(x[:1], max_new_tokens=4, num_beams=3, do_sample=False).shape == (1, 14)
        assert hf.generate(x[:1], max_new_tokens=4, do_sample=True, num_return_sequences=3).shape == (3, 14)
        assert hf.generate(x[:1], max_new_tokens=4, num_beams=1, do_sample=False)[0].tolist() == \
            model.generate(x[:1], 4)[0].tolist()
        with pytest.raises(ValueError, match="contiguous"):
            hf(x, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10]))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="overwrite"):
        export_checkpoint(ckpt, tmp_path / "busy")
    with pytest.raises(ExportError, match="not a model folder"):
        export_checkpoint(ckpt, tmp_path / "busy", overwrite=True)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    first = export_checkpoint(ckpt, tmp_path / "again", verify=False)
    assert export_checkpoint(ckpt, first, overwrite=True, dtype="bfloat16") == first  # an earlier export is replaced
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"


def test_lm_eval_hf_model_scores_as_platform_adapter(trained, tmp_path, hf_home):
    """lm-eval's own `hf` model (as `--model hf --model_args pretrained=...` builds it) on the exported folder
    scores the shipped offline tasks as the platform's adapter does on the checkpoint: multiple choice with the
    default arguments (the tokenizer adds BOS to contexts, like the adapter), rolling perplexity with
    add_bos_token=False (lm-eval would otherwise also score the BOS its tokenizer adds)."""
    import importlib

    import lm_eval.api.registry as reg
    importlib.import_module("lm_eval.models")  # lm-eval's table of its model names, "hf" among them

    from falcon_lab.evaluation import FalconLabLM
    from falcon_lab.evaluation.downstream import run_suite
    from falcon_lab.hf.export import export_checkpoint
    out = export_checkpoint(trained, tmp_path / "hf")
    tasks = str(ROOT / "evaluation" / "tasks")
    mc = {"name": "mc", "include_path": tasks, "include_defaults": False, "num_fewshot": [0],
          "tasks": {"falcon_local_mc": "acc"}}
    rolling = {**mc, "name": "rolling", "tasks": {"falcon_local_rolling": "word_perplexity"}}
    # carry_state=False: the adapter scores in max_length windows, as lm-eval's hf model does (with the
    # default, a recurrent model carries its state across windows and sees the whole document instead)
    platform = FalconLabLM(checkpoint=trained, batch_size=4, device="cpu", carry_state=False)
    hf_cls = reg.get_model("hf")
    hf_lm = hf_cls.create_from_arg_string(f"pretrained={out},batch_size=4,device=cpu")
    hf_nobos = hf_cls.create_from_arg_string(f"pretrained={out},batch_size=4,device=cpu,add_bos_token=False")
    for suite, a, b in ((mc, platform, hf_lm), (rolling, platform, hf_nobos)):
        ra, rb = run_suite(a, suite), run_suite(b, suite)
        assert not ra.missing and not rb.missing, (ra.missing, rb.missing)
        (task,) = suite["tasks"]
        raw_a, raw_b = ra.raw[0][task], rb.raw[0][task]
        keys = [k for k in raw_a if k.endswith(",none") and "stderr" not in k]
        assert len(keys) >= 2, raw_a  # acc + acc_norm; word/byte perplexity + bits per byte
        for k in keys:
            assert raw_b[k] == pytest.approx(raw_a[k], rel=1e-5), (task, k, raw_a[k], raw_b[k])
    assert raw_a["word_perplexity,none"] > 1.0


def test_lazy_registration_and_remote_code_files(trained, tmp_path, hf_home):
    """`import falcon_lab` imports neither transformers nor torch (the export CLI above imports falcon_lab before
    transformers and verifies through AutoModelForCausalLM: the lazy registration works); the folder's
    trust_remote_code files (auto_map) load the model through transformers' dynamic modules."""
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from falcon_lab.hf import FalconLabConfig, FalconLabForCausalLM
    from falcon_lab.hf.export import export_checkpoint
    code = "import sys, falcon_lab; print(sorted(m for m in ('transformers', 'torch', 'lm_eval') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
    out = export_checkpoint(trained, tmp_path / "hf", verify=False)
    cj = json.loads((out / "config.json").read_text())
    assert cj["auto_map"]["AutoModelForCausalLM"] == "modeling_falcon_lab.FalconLabForCausalLM"
    assert isinstance(AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True), FalconLabForCausalLM)
    # what transformers does with auto_map where falcon_lab is not registered: load the classes from the folder
    for key, want in (("AutoConfig", FalconLabConfig), ("AutoModelForCausalLM", FalconLabForCausalLM)):
        cls = get_class_from_dynamic_module(cj["auto_map"][key], str(out))
        assert cls is want
    assert any(k.endswith(".modeling_falcon_lab") for k in sys.modules)  # imported from the folder's file


# ---------------------------------------------------------------------------------------------------
def test_tokenizers_byte_and_bpe_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from falcon_lab.data.corpus import kjv_sentences
    from falcon_lab.data.tokenizer import BPETokenizer, ByteTokenizer
    from falcon_lab.hf.tokenizer import CHECK_TEXTS, export_tokenizer
    for tok in (ByteTokenizer(), BPETokenizer.train(kjv_sentences("validation")[:200], 400)):
        d = tmp_path / tok.name
        export_tokenizer(tok, d, model_max_length=64)
        h = AutoTokenizer.from_pretrained(str(d))
        assert (h.bos_token_id, h.eos_token_id, h.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
        assert h.model_max_length == 64
        for text in CHECK_TEXTS + ("a" * 500, "\u00e9\U0001F600" * 20):
            ids = h.encode(text)
            assert ids == [tok.bos_id] + tok.encode(text)
            assert h.encode(text, add_special_tokens=False) == tok.encode(text)
            assert h.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        batch = h(["ab", "abcd"], padding=True)["input_ids"]
        assert batch[0][-1] == tok.pad_id


class _RankBPE:
    """tiktoken's algorithm on a tiny hand-trained rank table (the same attributes the exporter reads from a
    tiktoken Encoding): split with the pattern, then merge the lowest-ranked adjacent pair until none is left."""

    _pat_str = r"""'s|'t| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""

    def __init__(self, corpus: str, n_merges: int):
        import regex
        self._re = regex.compile(self._pat_str)
        ranks = {bytes([b]): b for b in range(256)}
        words = [list(bytes([b]) for b in w.encode()) for w in self._re.findall(corpus)]
        for _ in range(n_merges):
            counts = {}
            for w in words:
                for a, b in zip(w, w[1:]):
                    counts[a + b] = counts.get(a + b, 0) + 1
            if not counts:
                break
            best = max(counts, key=lambda k: (counts[k], k))
            ranks[best] = len(ranks)
            new_words = []
            for w in words:
                out, i = [], 0
                while i < len(w):
                    if i + 1 < len(w) and w[i] + w[i + 1] == best:
                        out.append(best)
                        i += 2
                    else:
                        out.append(w[i])
                        i += 1
                new_words.append(out)
            words = new_words
        self._mergeable_ranks = ranks
        self.eot = len(ranks)
        self._special_tokens = {"<|endoftext|>": self.eot}

    def encode_ordinary(self, text):
        ids = []
        for piece in self._re.findall(text):
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                pairs = [(self._mergeable_ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
                pairs = [p for p in pairs if p[0] is not None]
                if not pairs:
                    break
                _, i = min(pairs)
                parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
            ids += [self._mergeable_ranks[p] for p in parts]
        return ids

    def decode_bytes(self, ids):
        inv = {v: k for k, v in self._mergeable_ranks.items()}
        return b"".join(inv[i] for i in ids if i in inv)


def test_tiktoken_ranks_become_equivalent_bpe_merges(tmp_path):
    """The gpt2 (tiktoken) export path on a rank table trained here (no download): the tokenizers BPE made from
    the ranks encodes every text exactly as rank-ordered BPE does."""
    from transformers import AutoTokenizer

    from falcon_lab.data.corpus import kjv_sentences
    from falcon_lab.hf.tokenizer import CHECK_TEXTS, export_tokenizer
    enc = _RankBPE(" ".join(kjv_sentences("validation")[:150]), 150)

    class Gpt2Like:  # the platform's TiktokenTokenizer surface, over the table above
        name = "gpt2"
        _enc = enc
        bos_id = eos_id = pad_id = enc.eot

        def encode(self, text):
            return enc.encode_ordinary(text)

        def decode(self, ids):
            return enc.decode_bytes([i for i in ids if i != enc.eot]).decode("utf-8", errors="replace")

        def state(self):
            return {"name": "gpt2"}

    tok = Gpt2Like()
    texts = CHECK_TEXTS + tuple(kjv_sentences("test")[:30])
    export_tokenizer(tok, tmp_path / "t", texts=texts)
    h = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    merged = [i for t in texts for i in tok.encode(t) if i >= 256]
    assert len(merged) > 50  # the merges are exercised, not only single bytes
    for t in texts:
        assert h.encode(t) == [enc.eot] + tok.encode(t)


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs", [{"variant": "1A"}, {"variant": "3", "preset": ".2", "window": 3}],
                         ids=["1A", "3_w3"])
def test_falcon_attention_is_the_platform_mixer(knobs):
    """fla's layer shape over the platform's FalconMixer: same output for the same weights; padding (fla's
    unpadding) and cu_seqlens equal per-sequence runs; a cached prefill + one-token steps equal the full pass."""
    from falcon_lab.hf import FalconAttention, FalconLabCache
    from falcon_lab.layers.registry import build_mixer
    torch.manual_seed(0)
    D, H = 48, 3
    ref = build_mixer({"name": "falcon", **knobs}, D, H, D // H, 0).eval()
    layer = FalconAttention(hidden_size=D, num_heads=H, layer_idx=0, **knobs).eval()
    layer.mixer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 13, D)
    with torch.no_grad():
        o, attn, pkv = layer(x)
        assert attn is None and pkv is None
        assert torch.equal(o, ref(x)[0])
        # padding mask: left-pad row 0 by 4, right-pad row 1 by 2
        mask = torch.ones(2, 13, dtype=torch.long)
        mask[0, :4] = 0
        mask[1, -2:] = 0
        o, _, _ = layer(x, attention_mask=mask)
        assert torch.allclose(o[0, 4:], ref(x[:1, 4:])[0][0], atol=1e-5)
        assert torch.allclose(o[1, :11], ref(x[1:, :11])[0][0], atol=1e-5)
        assert o[0, :4].abs().sum() == 0 and o[1, 11:].abs().sum() == 0
        # packed varlen
        cu = torch.tensor([0, 5, 13])
        o, _, _ = layer(x[:1], cu_seqlens=cu)
        assert torch.allclose(o[0, :5], ref(x[:1, :5])[0][0], atol=1e-5)
        assert torch.allclose(o[0, 5:], ref(x[:1, 5:])[0][0], atol=1e-5)
        # decoding through a cache (fla's layer-cache interface)
        cache = FalconLabCache()
        o1, _, cache = layer(x[:, :9], past_key_values=cache, use_cache=True)
        steps = [layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(9, 13)]
        assert cache.get_seq_length() == 13
        full = ref(x)[0]
        assert torch.allclose(torch.cat([o1] + steps, dim=1), full, atol=1e-4)
        # with padding and a cache: per-sequence states, stacked; decoding continues each row
        cache = FalconLabCache()
        layer(x[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
        step, _, _ = layer(x[:, 9:10], attention_mask=mask[:, :10].clone().fill_(1), past_key_values=cache,
                           use_cache=True)
        assert torch.allclose(step[0, 0], ref(x[:1, 4:10])[0][0, -1], atol=1e-4)
        assert torch.allclose(step[1, 0], ref(x[1:, :10])[0][0, -1], atol=1e-4)
    with pytest.raises(ValueError, match="not a knob"):
        FalconAttention(hidden_size=D, num_heads=H, no_such_knob=1)


def test_fla_check_script_parses_and_refuses_without_fla(tmp_path):
    """experiments/h200/fla_layer_check.py is for a GPU machine with fla; here it must say so (exit code 2) and
    still write its JSON."""
    import importlib.util

    from script_helpers import load_script

    mod = load_script("experiments/h200/fla_layer_check.py")
    out = tmp_path / "r.json"
    code = mod.main(["--out", str(out), "--steps", "2"])
    res = json.loads(out.read_text())
    if importlib.util.find_spec("fla") is None or not torch.cuda.is_available():
        assert code == 2 and res["ok"] is False and res["reason"] and res["exit_code"] == 2
    else:  # pragma: no cover - a GPU machine with fla
        assert code in (0, 1) and "fla_losses" in res
