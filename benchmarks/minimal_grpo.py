"""A minimal GRPO loop in plain PyTorch + transformers (no plait): the baseline of vs_minimal.py.

The step of benchmarks/grpo_workload.py, written the way one would by hand, nanoGPT-style: one
model object samples and trains (no weight sync), float32.

- Sampling (no grad, eval mode): the step's prompts share a long prefix (the chat template's
  system prompt and three worked examples), which runs once; its KV cache is repeated for the
  prompts, whose distinct suffixes (left-padded) run once; each prompt's cache is repeated for its
  samples; then one decode step per token with the cache, temperature-1 sampling (inverse CDF),
  finished rows (end-of-turn token) leave the batch. Each sampled token's logprob is kept.
- Reward: the decoded reply, stripped, equals the answer. GRPO advantages per group,
  (r - mean) / (population std + 1e-6); groups with equal rewards are left out.
- Training: one forward/backward over the kept groups' token tree packed in one row (the common
  prefix once, each prompt once, every completion; a 4-D mask keeps each token to its ancestors),
  the output head only where completion tokens are predicted. (`--train padded`: every sequence
  whole instead, left-padded, 16 per micro-batch, which beats all 64 in one pass: 5-20x the time.)
  loss = -sum(exp(lp - lp_sampled) * A) / (completion tokens of the kept sequences): plait's
  importance_sampling loss with its token-mean normalisation. Gradient clipping at 1; AdamW with
  plait's trainer defaults (betas 0.9/0.95, eps 1e-8, no weight decay), fused.

    python benchmarks/minimal_grpo.py --model-dir DIR --tasks tasks.jsonl [--steps 20] [--check]
        [--json out.json]

`--check` also scores every sample of the first step with a fresh unpadded forward pass and
asserts that the sampled logprobs match it within 1e-4, and that the tree and padded layouts give
the same gradient. Every step reports max |training logprob - sampled logprob| (on-policy: ~1e-5).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

GROUPS, GROUP_SIZE, MAX_TOKENS, TEMPERATURE = 8, 8, 8, 1.0
LR, BETAS, EPS, GRAD_CLIP = 2e-5, (0.9, 0.95), 1e-8, 1.0


def lcp(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs) - 1  # every prompt keeps at least one token of its own
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


@torch.no_grad()
def sample(
    model, prompts: list[list[int]], n: int, stop: set[int], pad: int, gen: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """`n` completions of every prompt: (tokens, sampled logprobs) per row, prompt-major."""
    model.eval()
    p = lcp(prompts)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompts[0][:p]]), cache=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(len(prompts))
    ids, smask = left_pad([s[p:] for s in prompts], pad)  # padding sits between prefix and suffix
    mask = torch.cat([torch.ones(len(prompts), p, dtype=torch.long), smask], dim=1)
    pos = p + smask.cumsum(-1) - 1
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    cache.batch_repeat_interleave(n)
    mask, logits = mask.repeat_interleave(n, 0), logits.repeat_interleave(n, 0)
    pos = pos[:, -1].repeat_interleave(n) + 1
    rows = torch.arange(len(prompts) * n)  # original row of each live batch row
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    for t in range(MAX_TOKENS):
        logp = torch.log_softmax(logits.float(), dim=-1)
        probs = (
            logp.exp() if TEMPERATURE == 1 else torch.softmax(logits.float() / TEMPERATURE, dim=-1)
        )
        # Inverse-CDF draw: torch.multinomial takes ~100 ms for 64 x 49k on one CPU core, this
        # ~3 ms.
        cdf = probs.cumsum(-1)
        u = torch.rand(len(rows), 1, generator=gen) * cdf[:, -1:]
        nxt = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        for r, tok, v in zip(rows.tolist(), nxt.tolist(), lp.tolist(), strict=True):
            tokens[r].append(tok)
            logprobs[r].append(v)
        live = torch.tensor([tok not in stop for tok in nxt.tolist()])
        if t == MAX_TOKENS - 1 or not live.any():
            break
        if not live.all():  # finished rows leave the batch
            keep = live.nonzero().squeeze(-1)
            cache.reorder_cache(keep)
            rows, nxt, mask, pos = rows[keep], nxt[keep], mask[keep], pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=pos[:, None],
            cache=cache,
            use_cache=True,
        ).logits[:, -1]
        pos = pos + 1
    return tokens, logprobs


def score_padded(model, seqs: list[list[int]], ncomp: list[int], pad: int) -> torch.Tensor:
    """Logprobs of the last ncomp[i] tokens of every sequence, flat (row-major), one left-padded
    pass."""
    ids, mask = left_pad(seqs, pad)
    c = max(ncomp)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=c + 1
    ).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, -c:, None]).squeeze(-1)
    return lp[torch.arange(c)[None, :] >= (c - torch.tensor(ncomp))[:, None]]


def score_tree(model, prompts: list[list[int]], comps: list[list[list[int]]]) -> torch.Tensor:
    """Logprobs of every completion of comps[g] (completions of prompts[g]), flat (row-major), in
    one forward pass over one packed row holding the step's token tree: the common prefix once,
    each prompt's suffix once, each completion but its last token; position ids run along each
    path, and a token attends to its ancestors only (a 4-D boolean mask)."""
    p = lcp(prompts)
    toks, pos, segs, heads, targets = [], [], [], [], []

    def add(tokens: list[int], start: int, ancestors: list[int]) -> int:
        segs.append((len(toks), len(toks) + len(tokens), ancestors))
        toks.extend(tokens)
        pos.extend(range(start, start + len(tokens)))
        return len(segs) - 1

    root = add(prompts[0][:p], 0, [])
    for prompt, group in zip(prompts, comps, strict=True):
        suffix = add(prompt[p:], p, [root])
        for comp in group:
            seg = add(comp[:-1], len(prompt), [root, suffix])
            heads += [
                segs[suffix][1] - 1,
                *range(segs[seg][0], segs[seg][1]),
            ]  # the states that predict comp
            targets += comp
    allowed = torch.zeros(len(toks), len(toks), dtype=torch.bool)
    for start, end, ancestors in segs:
        allowed[start:end, start:end] = torch.ones(
            end - start, end - start, dtype=torch.bool
        ).tril()
        for a in ancestors:
            allowed[start:end, segs[a][0] : segs[a][1]] = True
    hidden = model.model(
        input_ids=torch.tensor([toks]),
        position_ids=torch.tensor([pos]),
        attention_mask=allowed[None, None],
        use_cache=False,
    ).last_hidden_state[0]
    logits = model.lm_head(
        hidden[heads]
    )  # the output head only where a completion token is predicted
    return (
        torch.log_softmax(logits.float(), dim=-1)
        .gather(-1, torch.tensor(targets)[:, None])
        .squeeze(-1)
    )


def policy_loss(
    model, prompts, comps, old_lps, adv, kept, pad, mode: str, micro_batch: int
) -> float:
    """Backward of plait's importance_sampling loss with its token-mean normalisation over `kept`
    rows (all of each kept group); returns max |lp - lp_sampled| (0 when on-policy up to noise)."""
    ntok = sum(len(comps[i]) for i in kept)
    chunks = (
        [kept[s : s + micro_batch] for s in range(0, len(kept), micro_batch)]
        if mode == "padded"
        else [kept]
    )
    mismatch = 0.0
    for mb in chunks:
        if mode == "padded":
            lp = score_padded(
                model,
                [prompts[i // GROUP_SIZE] + comps[i] for i in mb],
                [len(comps[i]) for i in mb],
                pad,
            )
        else:
            groups = sorted({i // GROUP_SIZE for i in mb})
            lp = score_tree(
                model,
                [prompts[g] for g in groups],
                [comps[g * GROUP_SIZE : (g + 1) * GROUP_SIZE] for g in groups],
            )
        old = torch.tensor([v for i in mb for v in old_lps[i]])
        a = adv[mb].repeat_interleave(torch.tensor([len(comps[i]) for i in mb]))
        (-(torch.exp(lp - old) * a).sum() / ntok).backward()
        mismatch = max(mismatch, float((lp.detach() - old).abs().max()))
    return mismatch


def run(
    model_dir: str | Path,
    tasks_path: str | Path,
    steps: int,
    seed: int = 0,
    threads: int | None = None,
    train: str = "tree",
    micro_batch: int = 16,
    check: bool = False,
) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True
    )
    stop = {
        tok.eos_token_id,
        tok.convert_tokens_to_ids("<|im_end|>"),
        model.generation_config.eos_token_id,
    } - {None}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    tasks = [json.loads(line) for line in Path(tasks_path).read_text().splitlines()]
    assert len(tasks) >= steps * GROUPS, (
        f"{tasks_path} has {len(tasks)} tasks; {steps} steps need {steps * GROUPS}"
    )
    hist: dict[str, list[float]] = {
        k: [] for k in ("step_s", "sample_s", "train_s", "reward", "mismatch_max", "groups_kept")
    }
    for step in range(steps):
        t0 = time.perf_counter()
        batch = tasks[step * GROUPS : (step + 1) * GROUPS]
        prompts = [
            tok.apply_chat_template(
                b["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for b in batch
        ]
        comps, old_lps = sample(model, prompts, GROUP_SIZE, stop, pad, gen)
        texts = tok.batch_decode(comps, skip_special_tokens=True)
        rewards = torch.tensor(
            [float(t.strip() == batch[i // GROUP_SIZE]["answer"]) for i, t in enumerate(texts)]
        )
        t1 = time.perf_counter()
        if check and step == 0:  # at the weights that sampled; not timed
            check_step(model, prompts, comps, old_lps, pad)
            t0, t1 = t0 + time.perf_counter() - t1, time.perf_counter()
        r = rewards.view(GROUPS, GROUP_SIZE)
        adv = (
            (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)
        ).flatten()
        kept = [i for i in range(len(comps)) if r[i // GROUP_SIZE].max() > r[i // GROUP_SIZE].min()]
        model.train()
        mismatch = (
            policy_loss(model, prompts, comps, old_lps, adv, kept, pad, train, micro_batch)
            if kept
            else 0.0
        )
        if kept:  # plait skips the update when every group had equal rewards
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        for k, v in zip(
            hist,
            (t2 - t0, t1 - t0, t2 - t1, float(rewards.mean()), mismatch, len(kept) / GROUP_SIZE),
            strict=True,
        ):
            hist[k].append(v)
        print(
            f"step {step}: reward {hist['reward'][-1]:.3f} "
            f"kept {len(kept) // GROUP_SIZE}/{GROUPS} groups, "
            f"sample {t1 - t0:.2f}s train {t2 - t1:.2f}s total {t2 - t0:.2f}s, "
            f"|lp diff| {mismatch:.1e}",
            flush=True,
        )
    return {"threads": torch.get_num_threads(), "train": train, "micro_batch": micro_batch, **hist}


def check_step(
    model, prompts: list[list[int]], comps: list[list[int]], old_lps: list[list[float]], pad: int
) -> None:
    """Assert that the sampled logprobs are those of fresh, unpadded, cache-free forward passes,
    and that both training layouts give the same gradient."""
    model.eval()
    with torch.no_grad():
        worst = max(
            float(
                (
                    score_padded(model, [prompts[i // GROUP_SIZE] + c], [len(c)], pad)
                    - torch.tensor(old_lps[i])
                )
                .abs()
                .max()
            )
            for i, c in enumerate(comps)
        )
    print(
        f"check: max |sampled logprob - full forward logprob| = {worst:.2e} "
        f"over {len(comps)} samples",
        flush=True,
    )
    assert worst < 1e-4, worst
    adv, kept, grads = torch.linspace(-1, 1, len(comps)), list(range(2 * GROUP_SIZE)), []
    for mode in ("padded", "tree"):
        policy_loss(model, prompts, comps, old_lps, adv, kept, pad, mode, 16)
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
        model.zero_grad(set_to_none=True)
    rel = float((grads[0] - grads[1]).norm() / grads[0].norm())
    print(
        f"check: gradient of the tree layout vs the padded one: relative difference {rel:.2e}",
        flush=True,
    )
    assert rel < 1e-3, rel


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        required=True,
        help="the checkpoint (python -c 'import grpo_workload as w; "
        "print(w.model_dir())' from benchmarks/)",
    )
    parser.add_argument(
        "--tasks",
        required=True,
        help="JSON lines of {messages, answer} (grpo_workload.write_tasks)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--train",
        choices=("tree", "padded"),
        default="tree",
        help="tree: the step's token tree in one packed row; padded: every sequence whole, "
        "left-padded, in micro-batches",
    )
    parser.add_argument(
        "--micro-batch", type=int, default=16, help="sequences per forward/backward (padded)"
    )
    parser.add_argument(
        "--check", action="store_true", help="assert sampled logprobs = a fresh forward's"
    )
    parser.add_argument("--json", default=None, help="write the per-step results here")
    args = parser.parse_args()
    result = run(
        args.model_dir,
        args.tasks,
        args.steps,
        args.seed,
        args.threads,
        args.train,
        args.micro_batch,
        args.check,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
