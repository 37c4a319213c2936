"""SGLang's own draft loop on a path-keyed draft, for the tests against the real sglang."""

import torch


def sglang_draft_loop(draft, roots, topk, steps, N):
    """SGLang's own select_top_k_tokens + organize_draft_results on a path-keyed draft.

    hidden_states carry ids of frontier paths, so SGLang's own row selection tells us which
    parent each new frontier node came from."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    table = [(int(r),) for r in roots]
    hidden = torch.arange(len(roots), dtype=torch.float32)[:, None]  # root path ids
    probs = torch.stack([draft.logprobs(p).exp() for p in table])
    topk_p, topk_index = probs.topk(topk, dim=-1)
    scores, sl, tl, pl = None, [], [], []
    for i in range(steps):
        input_ids, hidden, scores, info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        sl.append(info[0]), tl.append(info[1]), pl.append(info[2])
        if i == steps - 1:
            break
        frontier = [table[int(h)] + (int(t),) for h, t in zip(hidden[:, 0], input_ids)]
        hidden = torch.arange(len(table), len(table) + len(frontier), dtype=torch.float32)[:, None]
        table += frontier
        probs = torch.stack([draft.logprobs(p).exp() for p in frontier])
        topk_p, topk_index = probs.topk(topk, dim=-1)
    return organize_draft_results(sl, tl, pl, N), (sl, tl, pl)
