"""Runs the official qwen-tts greedily (bf16, sdpa, CUDA) on a custom-voice checkpoint and stores
what the voxkernel comparison needs: the talker prefill rows, the trailing text rows (tts_pad
last), the raw codebook-0 logits of every talker step, and the greedy codes.

Usage: python3 official_dump.py --ckpt DIR --frames N --out FILE.safetensors [--device cpu]
"""
import argparse

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--frames", type=int, default=120)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (the acceptance run) or cpu")
    args = ap.parse_args()

    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(args.ckpt, dtype=torch.bfloat16, attn_implementation="sdpa",
                                        device_map=args.device)
    tts.model.eval()
    talker = tts.model.talker
    seen = {}
    logits = []
    hook = talker.codec_head.register_forward_hook(
        lambda _m, _i, out: logits.append(out[0, -1].detach().float().cpu()))
    original = talker.generate

    def recording_generate(*a, **kw):
        seen.update(kw)
        return original(*a, **kw)

    model_generate = tts.model.generate

    def recording_model_generate(*a, **kw):
        codes, hiddens = model_generate(*a, **kw)
        seen["codes"] = codes[0].detach().to(torch.int64).cpu()
        return codes, hiddens

    talker.generate = recording_generate
    tts.model.generate = recording_model_generate
    speaker = sorted(tts.model.config.talker_config.spk_id.keys())[0]
    with torch.no_grad():
        tts.generate_custom_voice(text="Hello world, this is a longer test of the frame megakernel.",
                                  speaker=speaker, language="english", non_streaming_mode=True,
                                  do_sample=False, subtalker_dosample=False,
                                  max_new_tokens=args.frames + 1)
    hook.remove()
    result = seen["codes"]
    prefill = seen["inputs_embeds"][0].float().cpu()
    trailing = seen["trailing_text_hidden"][0].float().cpu()
    pad = seen["tts_pad_embed"].reshape(1, -1).float().cpu()
    if not torch.equal(trailing[-1:], pad):
        trailing = torch.cat([trailing, pad])
    save_file({"prefill_embeds": prefill.contiguous(), "trailing_embeds": trailing.contiguous(),
               "logits_c0": torch.stack(logits).contiguous(), "codes": result.contiguous()}, args.out)
    print(f"official: speaker {speaker}, {prefill.shape[0]} prefill rows, {result.shape[0]} frames, "
          f"{len(logits)} logit rows")


if __name__ == "__main__":
    main()
