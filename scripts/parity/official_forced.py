"""The official model's own teacher-forced greedy choices, in several arithmetic settings, and how
often the settings agree with each other: the noise floor under the `megakernel_check`
agreement figure.

Given a dump from scripts/gpu/official_dump.py (prompt rows, trailing rows, greedy codes), each
setting (dtype x attention implementation) runs the official modules with the dumped codes forced
frame by frame, exactly as `megakernel_check` drives voxkernel: per frame the code predictor's own
greedy choice for groups 1..15 and the talker's own greedy next codebook 0 (repetition penalty,
suppressed control rows). Prints, per pair of settings, the share of equal choices and the
codebook-0 logits' relative error (max |a - b| / max |b|, max and mean over steps).

Usage: python3 official_forced.py --ckpt DIR --dump FILE [--device cuda] [--frames N]
       [--settings bf16:sdpa,bf16:eager,float32:sdpa]
"""
import argparse
import itertools
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def load_model(ckpt, dtype, attn, device):
    try:
        import official  # the torchaudio workaround, when this file sits beside it
        official.ensure_qwen_tts_importable()
    except ImportError:
        pass
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn, device_map=device)
    tts.model.eval()
    return tts.model


def forced_run(model, dump, frames, penalty, device):
    """Per frame: ([own c1..c15], own next c0, raw c0 logits of the step before the frame)."""
    from transformers import DynamicCache

    talker = model.talker
    dtype = talker.codec_head.weight.dtype
    predictor = talker.code_predictor
    cfg = talker.config
    eos = cfg.codec_eos_token_id
    vocab = cfg.vocab_size
    suppressed = [i for i in range(vocab - 1024, vocab) if i != eos]
    prefill = dump["prefill_embeds"].to(device, dtype)[None]
    trailing = dump["trailing_embeds"].to(device, dtype)
    codes = dump["codes"][:frames].tolist()
    cache = DynamicCache()
    n = prefill.shape[1]

    def talker_step(rows, start):
        pos = torch.arange(start, start + rows.shape[1], device=device)[None].expand(3, 1, -1)
        out = talker.model(inputs_embeds=rows, position_ids=pos, past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state[:, -1:]
        return hidden, talker.codec_head(hidden)[0, -1].float()

    hidden, logits = talker_step(prefill, 0)
    history, result = [], []
    for k, frame in enumerate(codes):
        pcache = DynamicCache()
        c0_row = talker.model.get_input_embeddings()(torch.tensor([[frame[0]]], device=device))
        rows = predictor.small_to_mtp_projection(torch.cat((hidden, c0_row), dim=1))
        own = []
        for j in range(15):
            pos = torch.arange(0 if j == 0 else j + 1, j + 2, device=device)[None]
            out = predictor.model(inputs_embeds=rows, position_ids=pos, past_key_values=pcache, use_cache=True)
            own.append(int(predictor.lm_head[j](out.last_hidden_state[:, -1]).float().argmax()))
            if j < 14:
                forced = torch.tensor([[frame[j + 1]]], device=device)
                rows = predictor.small_to_mtp_projection(predictor.model.get_input_embeddings()[j](forced))
        embeds = [c0_row] + [predictor.model.get_input_embeddings()[i](torch.tensor([[frame[i + 1]]], device=device))
                             for i in range(15)]
        step_in = torch.cat(embeds, dim=1).sum(1, keepdim=True)
        step_in = step_in + trailing[min(k, trailing.shape[0] - 1)][None, None]
        before = logits
        history.append(frame[0])
        hidden, logits = talker_step(step_in, n + k)
        scores = logits.clone()
        for i in set(history):
            scores[i] = scores[i] * penalty if scores[i] < 0 else scores[i] / penalty
        scores[suppressed] = float("-inf")
        result.append((own, int(scores.argmax()), before.cpu()))
    return result


def compare(a, b):
    agree = total = 0
    errs = []
    for k, ((own_a, next_a, la), (own_b, next_b, lb)) in enumerate(zip(a, b)):
        agree += sum(x == y for x, y in zip(own_a, own_b))
        total += 15
        if k + 1 < len(a):
            agree += next_a == next_b
            total += 1
        errs.append(((la - lb).abs().max() / lb.abs().max()).item())
    return agree / total, max(errs), sum(errs) / len(errs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=120)
    ap.add_argument("--settings", default="bf16:sdpa,bf16:eager,float32:sdpa")
    args = ap.parse_args()
    dtypes = {"bf16": torch.bfloat16, "float32": torch.float32}
    dump = load_file(args.dump)
    codes = dump["codes"][:args.frames].tolist()
    with open(os.path.join(args.ckpt, "generation_config.json")) as f:
        penalty = json.load(f)["repetition_penalty"]
    runs = {}
    for setting in args.settings.split(","):
        dtype, _, attn = setting.partition(":")
        if dtype not in dtypes or attn not in ("sdpa", "eager"):
            sys.exit(f"--settings: {setting!r} is not DTYPE:ATTN with DTYPE one of {', '.join(dtypes)} "
                     "and ATTN one of sdpa, eager")
        model = load_model(args.ckpt, dtypes[dtype], attn, args.device)
        with torch.no_grad():
            runs[setting] = forced_run(model, dump, args.frames, penalty, args.device)
        del model
        own_equal = sum(o == f[1:] for (o, _, _), f in zip(runs[setting], codes))
        print(f"{setting}: {len(runs[setting])} frames forced; frames whose own c1..c15 equal the dump's: {own_equal}")
    for x, y in itertools.combinations(runs, 2):
        agree, emax, emean = compare(runs[x], runs[y])
        print(f"{x} vs {y}: teacher-forced greedy agreement {agree:.4f}, c0 logits rel err max {emax:.3e} mean {emean:.3e}")


if __name__ == "__main__":
    main()
