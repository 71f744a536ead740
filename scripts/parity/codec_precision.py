#!/usr/bin/env python3
"""How far float32 rounding alone moves the official codec decode on the parity fixtures.

For every case file with `codes` and `wav`, decodes the codes with the official speech tokenizer
decoder in float32 and in float64 and prints max abs / RMS of f32 - f64, plus how far the stored
fixture `wav` is from this f32 decode (0 unless torch's kernels changed). Also prints the largest
activation magnitudes inside the decoder (conditioning: rounding errors scale with them). The f32-f64
gap is the floor under any f32 re-implementation's distance from the fixture (docs/codec.md).

    /work/refenv/bin/python scripts/parity/codec_precision.py tests/fixtures/parity
    /work/refenv/bin/python scripts/parity/codec_precision.py --speech-tokenizer <ckpt>/speech_tokenizer \
        --frames 12 [--save-case codes_wav.safetensors]   # random codes, e.g. on a full-size random codec
"""
import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from official import ensure_qwen_tts_importable  # noqa: E402


def load_decoder(speech_tokenizer: Path):
    ensure_qwen_tts_importable()
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    codec = Qwen3TTSTokenizerV2Model.from_pretrained(str(speech_tokenizer), dtype=torch.float32)
    return codec.decoder.eval()


def largest_activations(decoder, codes):
    """Max |x| of the quantizer latent (pre_conv output) and over the outputs of the upsampling and
    vocoder stages after the transformer, up to the last SnakeBeta (rounding errors scale with them)."""
    latent, vocoder = [], []
    hooks = [decoder.pre_conv.register_forward_hook(lambda _m, _i, out: latent.append(out.abs().max().item()))]
    hooks += [m.register_forward_hook(lambda _m, _i, out: vocoder.append(out.abs().max().item()))
              for m in [*decoder.upsample, *decoder.decoder[:-1]]]
    with torch.no_grad():
        decoder(codes)
    for hook in hooks:
        hook.remove()
    return max(latent), max(vocoder)


def compare(name, decoder32, decoder64, codes, stored=None):
    codes = codes.T.unsqueeze(0)  # [frames, 16] -> [1, 16, frames], the decoder's layout
    with torch.no_grad():  # chunked_decode: the official decode path, one pass up to 300 frames
        wav32 = decoder32.chunked_decode(codes)[0, 0]
        wav64 = decoder64.chunked_decode(codes)[0, 0]
    diff = wav32.double() - wav64
    latent, vocoder = largest_activations(decoder32, codes)
    line = (f"{name:60s} f32 vs f64: max {diff.abs().max():.2e} rms {diff.pow(2).mean().sqrt():.2e}"
            f"  |wav| max {wav32.abs().max():.3f}  |x| max: latent {latent:.1f}, vocoder {vocoder:.1f}")
    if stored is not None:
        line += f"  fixture vs f32: max {(stored - wav32).abs().max():.1e}"
    print(line)
    return diff.abs().max().item(), wav32, wav64


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default="tests/fixtures/parity")
    ap.add_argument("--speech-tokenizer", type=Path, help="decode random codes with this codec instead")
    ap.add_argument("--frames", type=int, default=12, help="random frames for --speech-tokenizer")
    ap.add_argument("--save-case", type=Path, help="with --speech-tokenizer: write its codes, the official f32 "
                    "wav and the f64 decode (wav64) here (VOXKERNEL_CODEC_CASE of the full-size codec_decoder "
                    "test, codec_bench --case)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    from safetensors.torch import load_file, save_file

    if args.speech_tokenizer:
        decoder32 = load_decoder(args.speech_tokenizer)
        codes = torch.randint(0, 2048, (args.frames, 16), generator=torch.Generator().manual_seed(12))
        _, wav, wav64 = compare(f"{args.frames} random frames", decoder32, copy.deepcopy(decoder32).double(),
                                codes)
        if args.save_case:
            # wav64 rounded to float32 (3e-8 at most for |x| <= 1): the float64 decode, for
            # codec_bench --case to measure every float32 decode against
            save_file({"codes": codes, "wav": wav.contiguous(), "wav64": wav64.float().contiguous()},
                      str(args.save_case))
        return
    worst = 0.0
    decoders = {}  # fixture checkpoints share one codec through a symlink: load each file once
    for case in sorted(Path(args.root).glob("*/cases/*.safetensors")):
        weights = (case.parent.parent / "speech_tokenizer" / "model.safetensors").resolve()
        if weights not in decoders:
            decoder32 = load_decoder(case.parent.parent / "speech_tokenizer")
            decoders[weights] = (decoder32, copy.deepcopy(decoder32).double())
        tensors = load_file(str(case))
        name = f"{case.parent.parent.name}/{case.stem}"
        worst = max(worst, compare(name, *decoders[weights], tensors["codes"], tensors["wav"])[0])
    print(f"largest f32 vs f64 max abs: {worst:.2e}")


if __name__ == "__main__":
    main()
