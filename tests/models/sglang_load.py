"""Run as a script: load a saved draft head with SGLang 0.5.23's own EAGLE / EAGLE-3 model class and loader, as a
server would, and print what landed (JSON): the parameters no checkpoint tensor filled, the checkpoint tensors
SGLang's ``load_weights`` dropped, and whether every loaded value equals the checkpoint's.

    python tests/models/sglang_load.py TARGET_DIR DRAFT_DIR EAGLE|EAGLE3 PORT
"""

import json
import os
import sys

import torch

# (ours, SGLang's) fused names: q/k/v -> qkv_proj, gate/up -> gate_up_proj (the rows in this order)
FUSED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
         ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def main(target, draft, algo, port):
    from treespec_sglang.plugin.cpu import install

    install(force=True)
    from safetensors.torch import load_file
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=target, device="cpu", dtype="float32", skip_tokenizer_init=True,
                    speculative_algorithm=algo, speculative_draft_model_path=draft, speculative_eagle_topk=2,
                    speculative_num_steps=2, speculative_num_draft_tokens=4, attention_backend="intel_amx",
                    disable_cuda_graph=True)
    rc.publish(sa, role="scheduler")
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")
    rc.get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_cp_rank=0, moe_dp_rank=0, moe_ep_rank=0,
                                           moe_tp_rank=0)
    mc = ModelConfig.from_server_args(sa, model_path=draft, is_draft_model=True)
    with set_default_torch_dtype(mc.dtype):
        model = _initialize_model(mc, LoadConfig())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    sd = load_file(os.path.join(draft, "model.safetensors"))
    model.load_weights(list(sd.items()))
    nq = {}
    for k, v in sd.items():
        for ours, (_, i) in FUSED.items():
            if ours in k:
                nq[(k.replace(ours, "#"), i)] = v.shape[0]
    dropped, differ = [], []
    for k, v in sd.items():
        if k in ("d2t", "t2d"):
            continue
        name, rows = k, None
        for ours, (theirs, i) in FUSED.items():
            if ours in k:
                name = k.replace(ours, theirs)
                start = sum(nq.get((k.replace(ours, "#"), j), 0) for j in range(i))
                rows = (start, start + v.shape[0])
        name = name if name in params else "model." + name
        if name not in params:
            dropped.append(k)
            continue
        got = params[name].detach().float()
        got = got[rows[0]:rows[1]] if rows else got[:v.shape[0]]  # an LM head's rows padded past the vocab
        if not torch.equal(got, v.float()):
            differ.append(k)
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p.float()).any())
    hot = getattr(model, "hot_token_id", None)
    print(json.dumps(dict(unloaded=unloaded, dropped=sorted(dropped), differ=sorted(differ),
                          hot=None if hot is None else hot.tolist())))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
