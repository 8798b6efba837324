"""FalconAttention inside an fla model on a GPU (issue 20): a few training steps, next to the platform's decoder.

    python experiments/h200/fla_layer_check.py --out results/fla_layer_check.json [--steps 200 --family gated_deltanet]

What it does (one GPU, bf16 autocast, the embedded KJV corpus as bytes, the same batches for both models):
1. builds an fla `<Family>ForCausalLM` (default GatedDeltaNet) and replaces every layer's `attn` with
   falcon_lab's `FalconAttention` (falcon_lab/hf/layer.py: the platform's FalconMixer, fla's layer signature),
   initialised as the platform initialises its mixers (N(0, 0.02) matrices, output projection / sqrt(2L));
2. checks the layer inside the fla model: a packed batch through `cu_seqlens` gives the same logits as the
   sequences one by one, and fla's own `generate` (its Cache carrying FalconState + conv state) gives the
   same greedy tokens as re-running the full forward each token;
3. trains it `--steps` AdamW steps, and the platform's own decoder (falcon_lab.models.build_model, same
   width / depth / heads / Falcon knobs) on the same batches;
4. PASS when the fla model's loss decreased (mean of the last tenth of the steps below the first tenth by
   --min-drop nats), both checks held, and its final loss is within --tol nats of the platform model's
   (the two models differ outside the mixer: fla's MLP, norms and an untied head).
Prints one RESULT line and writes every number to the JSON path given with --out. Exit 0 PASS, 1 FAIL, 2 could
not run (no CUDA, fla missing, an fla API this script does not know: the reason is in the JSON).
Needs on the GPU machine: fla-core *and* flash-linear-attention (fla.models, fla.layers) and transformers;
falcon_lab.hf.layer itself needs only torch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--family", default="gated_deltanet", help="fla model family whose attention layers are replaced")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variant", default="1A")
    p.add_argument("--preset", default=".3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-drop", type=float, default=0.5, help="required loss decrease (nats), first vs last tenth")
    p.add_argument("--tol", type=float, default=0.25, help="allowed |fla - platform| final loss gap (nats)")
    return p.parse_args(argv)


def batches(n_steps, batch, seq_len, seed, device):
    import torch

    from falcon_lab.data.corpus import load_kjv
    from falcon_lab.data.tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    ids = []
    for d in load_kjv("train"):
        ids += [tok.bos_id] + tok.encode(d["text"])
    data = torch.tensor(ids, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).to(device), tok


def platform_init(layer, n_layers, std=0.02):
    """falcon_lab.models.decoder.Decoder._init on one FalconAttention."""
    import torch.nn as nn
    for name, p in layer.named_parameters():
        if p.dim() == 2 and "gate_proj" not in name and "lam_proj" not in name:
            s = std / math.sqrt(2 * n_layers) if name.endswith("o_proj.weight") else std
            nn.init.normal_(p, 0.0, s)


def build_fla(args, vocab, device):
    import fla.models as fm

    from falcon_lab.hf.layer import FalconAttention
    camel = "".join(w.capitalize() for w in args.family.split("_")).replace("Deltanet", "DeltaNet")
    cfg_cls, model_cls = getattr(fm, f"{camel}Config"), getattr(fm, f"{camel}ForCausalLM")
    hd = args.d_model // args.heads
    cfg = cfg_cls(hidden_size=args.d_model, num_hidden_layers=args.layers, num_heads=args.heads, head_dim=hd,
                  vocab_size=vocab)
    model = model_cls(cfg)
    layers = model.model.layers
    for i, blk in enumerate(layers):
        blk.attn = FalconAttention(hidden_size=args.d_model, num_heads=args.heads, head_dim=hd, layer_idx=i,
                                   variant=args.variant, preset=args.preset)
        platform_init(blk.attn, args.layers)
    return model.to(device), f"{model_cls.__module__}.{model_cls.__name__}"


def build_platform(args, vocab, device):
    from falcon_lab.models import build_model
    m = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads, "head_dim": args.d_model // args.heads}
    return build_model(m, {"name": "falcon", "variant": args.variant, "preset": args.preset}, vocab).to(device)


def lm_loss(logits, y):
    import torch.nn.functional as F
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def check_varlen(model, vocab, device):
    """Packed [1, a+b] with cu_seqlens == the two sequences run alone (fla passes cu_seqlens to every layer)."""
    import torch
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (1, 37), generator=g), torch.randint(0, 256, (1, 91), generator=g)
    x = torch.cat([a, b], 1).to(device)
    cu = torch.tensor([0, 37, 128], device=device, dtype=torch.int32)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        packed = model(input_ids=x, cu_seqlens=cu).logits.float()
        sep = torch.cat([model(input_ids=a.to(device)).logits.float(), model(input_ids=b.to(device)).logits.float()], 1)
    diff = float((packed - sep).abs().max())
    return {"max_abs_diff": diff, "ok": diff < 5e-2 * max(1.0, float(sep.abs().max()))}


def check_generate(model, device, n=16):
    """fla's generate (its Cache holds FalconState and the conv cache) == greedy by full re-forward."""
    import torch
    prompt = torch.tensor([[256] + list(b"In the beginning God created")], device=device)
    with torch.no_grad():
        gen = model.generate(input_ids=prompt, max_new_tokens=n, do_sample=False, use_cache=True)[0, prompt.shape[1]:]
        ids = prompt
        for _ in range(n):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        ref = ids[0, prompt.shape[1]:]
    same = int((gen[:len(ref)] == ref[:len(gen)]).sum())
    return {"cached": gen.tolist(), "reforward": ref.tolist(), "agree": same, "of": n, "ok": same >= n - 2}


def train(model, data, lr, fla_model):
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    model.train()
    for xy, _ in data:
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast("cuda", torch.bfloat16):
            logits = model(input_ids=x).logits if fla_model else model(x)
        loss = lm_loss(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
    model.eval()
    return losses


def main(argv=None) -> int:
    args = parse(argv)
    res = {"ok": False, "reason": None, "args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    code = 2
    try:
        import torch
        if not torch.cuda.is_available():
            res["reason"] = "no CUDA device: run this on the GPU machine"
            return code
        try:
            import fla  # noqa: F401
            res["fla_version"] = getattr(fla, "__version__", "?")
        except ImportError as e:
            res["reason"] = f"fla is not installed ({e}): carry its wheel (docs/benchmarks.md)"
            return code
        res["torch"], res["device"] = torch.__version__, torch.cuda.get_device_name()
        device = torch.device("cuda")
        vocab = 320
        torch.manual_seed(args.seed)
        try:
            model, res["fla_model"] = build_fla(args, vocab, device)
        except ImportError as e:  # fla-core alone has no fla.models: the flash-linear-attention package has
            res["reason"] = (f"fla's models are not importable ({e}): install/carry flash-linear-attention (and "
                             f"transformers) besides fla-core")
            return code
        except (AttributeError, TypeError) as e:
            res["reason"] = f"could not build fla's {args.family} model with FalconAttention: {type(e).__name__}: {e}"
            return code
        torch.manual_seed(args.seed)
        ref = build_platform(args, vocab, device)
        res["params"] = {"fla": sum(p.numel() for p in model.parameters()), "platform": ref.num_params()}
        t0 = time.time()
        res["fla_losses"] = train(model, batches(args.steps, args.batch, args.seq_len, args.seed, device), args.lr, True)
        res["fla_s"] = time.time() - t0
        t0 = time.time()
        res["platform_losses"] = train(ref, batches(args.steps, args.batch, args.seq_len, args.seed, device), args.lr, False)
        res["platform_s"] = time.time() - t0
        for name, fn in (("varlen", lambda: check_varlen(model, vocab, device)),
                         ("generate", lambda: check_generate(model, device))):
            try:
                res[name] = fn()
            except Exception as e:  # an fla API difference: reported, counted as a failed check
                res[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        k = max(1, args.steps // 10)
        fl, pl = res["fla_losses"], res["platform_losses"]
        first, last, plast = sum(fl[:k]) / k, sum(fl[-k:]) / k, sum(pl[-k:]) / k
        res.update(fla_first=first, fla_last=last, platform_last=plast, gap=last - plast,
                   decreased=first - last >= args.min_drop, within_tol=abs(last - plast) <= args.tol)
        res["ok"] = bool(res["decreased"] and res["within_tol"] and res["varlen"]["ok"] and res["generate"]["ok"])
        code = 0 if res["ok"] else 1
        if not res["ok"]:
            res["reason"] = ", ".join(w for w, bad in (("loss did not decrease", not res["decreased"]),
                                                      ("loss gap beyond tol", not res["within_tol"]),
                                                      ("varlen check failed", not res["varlen"]["ok"]),
                                                      ("generate check failed", not res["generate"]["ok"])) if bad)
        return code
    except Exception as e:  # anything else: recorded, exit 2
        res["reason"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()[-4000:]
        return code
    finally:
        res["exit_code"] = code
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        if res.get("fla_last") is not None:
            print(f"RESULT: {'PASS' if res['ok'] else 'FAIL'}  fla+FalconAttention loss {res['fla_first']:.3f} -> "
                  f"{res['fla_last']:.3f}, platform decoder {res['platform_last']:.3f} (gap {res['gap']:+.3f}, tol "
                  f"{args.tol}); varlen {res['varlen'].get('ok')}, generate {res['generate'].get('ok')}"
                  f"{'' if res['ok'] else ' — ' + str(res['reason'])}  -> {args.out}", flush=True)
        else:
            print(f"RESULT: NOT RUN — {res['reason']}  -> {args.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
