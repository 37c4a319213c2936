"""GPU: the verify cost curve t(T) of a real-size target, the curve the batch's token cap is
spent on. Where t(T) is flat, extra nodes are free and every request may keep its whole tree; past the knee
(the compute-bound regime) the batch's total verified tokens is the constraint that
``token_cap`` / ``--treespec-token-cap`` allocates.

The project's own Llama (``treespec_sglang.models.llama``) at Llama-3.1-8B's shape with random bf16 weights
(timing does not depend on the values), ``bs`` requests with a ``--prefix``-token cache each, one verify
forward of ``T`` tree tokens for the whole batch: the padded grid (every request at ``ceil(T / bs)``) and the
ragged form (``rows=``: linears on the ``T`` kept tokens only), target LM head included. CUDA events,
median of ``--iters`` CUDA-graph replays (eager launches of
32 layers cost more than the GPU work at these sizes).

    python bench/gpu_verify_cost.py --bs 1,8,32 --tokens-per-request 1,2,4,8,16,32,64 --out cost.json
"""

import argparse
import json
import os
import sys

import torch

from treespec_sglang.utils.cuda_graphs import capture

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0)


def graphed(fn):
    """``fn`` captured once as a CUDA graph -> its replay (what a server runs: no per-op launch cost)."""
    return capture(fn, warmup=2)[0].replay


def timed(fn, iters):
    """Median ms of ``iters`` CUDA-graph replays of ``fn`` (CUDA events)."""
    from flashinfer_ragged_verify import timed as median_ms  # beside this script

    return median_ms(graphed(fn), iters)


@torch.inference_mode()
def main():
    from treespec_sglang.engine.kv_cache import KVCache
    from treespec_sglang.models.llama import LlamaConfig, LlamaModel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,8,32")
    ap.add_argument("--tokens-per-request", default="1,2,4,8,16,32,64")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3.1-8B)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    cfg = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": a.layers})
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaModel(cfg).to(dt).eval()
    for p in model.parameters():
        p.normal_(0, 0.02)
    model.fuse_()
    rows_out = []
    print(f"| bs | tokens/request | T | padded ms | ragged ms (T kept of bs x {max(int(x) for x in a.tokens_per_request.split(','))}) | ms per token |")
    print("|---|---|---|---|---|---|")
    widths = [int(x) for x in a.tokens_per_request.split(",")]
    for bs in [int(x) for x in a.bs.split(",")]:
        top = max(widths)
        cache = KVCache(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, a.prefix + top, cfg.head_dim, dt, dev)
        for w in widths:
            ids = torch.randint(0, cfg.vocab_size, (bs, w), device=dev)
            pos = a.prefix + torch.arange(w, device=dev)[None].expand(bs, w)
            kv = a.prefix + w
            mask = torch.ones(bs, w, kv, dtype=torch.bool, device=dev).tril(a.prefix)

            def padded():
                return model.lm_head(model(ids, pos, cache.stores(pos, kv), mask))

            t_pad = timed(padded, a.iters)
            # ragged: the same T = bs * w tokens kept out of a [bs, top] grid (half the requests deeper)
            t_rag = None
            if w < top:
                gids = torch.randint(0, cfg.vocab_size, (bs, top), device=dev)
                gpos = a.prefix + torch.arange(top, device=dev)[None].expand(bs, top)
                gmask = torch.ones(bs, top, a.prefix + top, dtype=torch.bool, device=dev).tril(a.prefix)
                rows = (torch.arange(bs, device=dev)[:, None] * top + torch.arange(w, device=dev)).reshape(-1)

                def ragged():
                    return model.lm_head(model(gids, gpos, cache.stores(gpos, a.prefix + top), gmask, rows=rows))

                t_rag = timed(ragged, a.iters)
            rows_out.append(dict(bs=bs, width=w, tokens=bs * w, padded_ms=t_pad, ragged_ms=t_rag))
            print(f"| {bs} | {w} | {bs * w} | {t_pad:.2f} | {'-' if t_rag is None else f'{t_rag:.2f}'} | "
                  f"{t_pad / (bs * w):.3f} |", flush=True)
        cache = None  # the closures above read this cell: dropped, the cache is freed
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), prefix=a.prefix, layers=a.layers, rows=rows_out), f,
                      indent=2)


if __name__ == "__main__":
    main()
