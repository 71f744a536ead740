#!/usr/bin/env python3
"""Voice-clone parity fixtures: a random Base checkpoint, synthetic reference clips, and what the
official qwen-tts 0.1.1 classes make of them (float32, CPU, greedy).

    /work/refenv/bin/python scripts/parity/make_clone_fixtures.py --out tests/fixtures/clone/tiny-base
    /work/refenv/bin/python scripts/parity/make_clone_fixtures.py --geometry 0.6b --out /tmp/clone-0.6b

The tiny checkpoint is committed (a few MB); the full-size one (2.5 GB) is not: rebuild it with the
second line and run the ignored test `clone_parity_full_size` (docs/voice_clone.md).

Output under --out:
- a Base checkpoint in the released layout (own speech tokenizer: not shared with tests/fixtures/parity);
- `audio/`: the reference clips. `ref_a.wav` and `ref_b.wav` are 24 kHz mono PCM16 (no resampling
  on either side, so everything downstream must match exactly); `ref_a_44k_stereo.wav`,
  `ref_a_16k.wav` are the same band-limited signal rendered at other rates (resampler study);
  `ref_a.flac` and `ref_a.mp3` are `ref_a` in other containers (decoder tests);
- `references/<clip>.safetensors`: `samples` (the f32 24 kHz waveform the official code encodes),
  `mel` [T, 128], `x_vector` [enc_dim], `ref_codes` [frames, 16] (int64);
- `cases/<case>.json` + `.safetensors`: request, official token ids and facts of the run;
  `prefill_embeds`, `codes` (generated), `wav` (the official output, reference part trimmed).
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from make_ckpt import REFERENCE, build_checkpoint, build_config, condition_codec_decoder, randomise  # noqa: E402
from make_fixtures import (Capture, check_unclamped, load_official, set_float32_numerics,  # noqa: E402
                           text_ids)

SR = 24000
SEED = 5
CODEC_SEED = 1005
REF_TEXT = "This is the reference transcript, spoken slowly."
TARGET = "Hello world, this is a test."

GEOMETRY = {
    "tiny": dict(size="tiny", text_hidden=4, talker_hidden=16, predictor_hidden=8),
    "0.6b": dict(size="0.6b", talker_hidden=1024),
}
# The tiny codec keeps one acoustic codebook past the 16 the wrapper uses (17 instead of the
# released 32) so the "first 16 codes" cut is exercised while the file stays small.
TINY_ENCODER_QUANTIZERS = 17
# ref_a: ICL text block shorter than the codec block (padded with tts_pad); ref_b: longer (spills
# into trailing). The full-size clip is speech-length, for timing.
CLIPS = {"tiny": {"ref_a": 3.0, "ref_b": 1.2}, "0.6b": {"ref_a": 6.0}}
MAX_NEW_TOKENS = {"tiny": 20, "0.6b": 10}


def speechlike(sr: int, seconds: float, seed: int) -> np.ndarray:
    """A voiced signal (< 7 kHz) with a moving pitch and syllable-rate envelope, the same
    continuous function at every sample rate, plus white noise at -60 dB: renderings at
    16/24/44.1 kHz differ by sampling and by their noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(sr * seconds)), dtype=np.float64) / sr
    f0 = 130.0 + 25.0 * np.sin(2 * np.pi * 0.6 * t) + 10.0 * np.sin(2 * np.pi * 2.3 * t + 1.0)
    # closed form of the integral of f0, so the phase does not depend on the sample rate
    phase = 2 * np.pi * (130.0 * t - 25.0 / (2 * np.pi * 0.6) * (np.cos(2 * np.pi * 0.6 * t) - 1)
                         - 10.0 / (2 * np.pi * 2.3) * (np.cos(2 * np.pi * 2.3 * t + 1.0) - np.cos(1.0)))
    y = np.zeros_like(t)
    for k in range(1, 31):
        formants = sum(np.exp(-((k * 150.0 - f) / 250.0) ** 2) for f in (600.0, 1200.0, 2600.0))
        y += (0.3 / k + formants) * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    for f in rng.uniform(200.0, 6500.0, size=12):
        y += 0.05 * np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 3.7 * t) ** 2
    y *= envelope
    # A recording's noise floor (-60 dB): without it the bins above 7 kHz hold only rounding
    # noise, where the official f32 STFT is itself 1.2e-4 (relative) off the exact log-mel.
    y = 0.45 * y / np.abs(y).max() + 1e-3 * rng.standard_normal(t.shape[0])
    return y.astype(np.float64)


def write_audio(out: Path, geometry: str):
    import soundfile as sf

    audio = out / "audio"
    audio.mkdir(parents=True, exist_ok=True)
    for index, (name, seconds) in enumerate(CLIPS[geometry].items()):
        sf.write(audio / f"{name}.wav", speechlike(SR, seconds, SEED + index), SR, subtype="PCM_16")
    seconds = CLIPS[geometry]["ref_a"]
    left = speechlike(44100, seconds, SEED)
    right = 0.6 * left + 0.2 * speechlike(44100, seconds, SEED + 100)
    sf.write(audio / "ref_a_44k_stereo.wav", np.stack([left, right], axis=1), 44100, subtype="PCM_16")
    sf.write(audio / "ref_a_16k.wav", speechlike(16000, seconds, SEED), 16000, subtype="PCM_16")
    if geometry == "tiny":
        y, _ = sf.read(audio / "ref_a.wav", dtype="float32")
        sf.write(audio / "ref_a.flac", y, SR, subtype="PCM_16")
        sf.write(audio / "ref_a.mp3", y, SR, format="MP3")


def rebuild_tiny_codec(out: Path):
    """The speech tokenizer of make_ckpt's tiny geometry, with TINY_ENCODER_QUANTIZERS."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    _, st = build_config("tiny", "base")
    # make_ckpt's tiny encoder has codebook_dim 8 but a 16-wide quantizer input, which only the
    # decoder-side fixtures could live with: Mimi's encode needs the two equal, as released (256).
    st["encoder_config"].update(num_quantizers=TINY_ENCODER_QUANTIZERS, codebook_dim=8,
                                vector_quantization_hidden_dimension=8)
    codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**{k: v for k, v in st.items()
                                                                   if k != "model_type"}))
    randomise(codec, torch.Generator().manual_seed(CODEC_SEED))
    condition_codec_decoder(codec.decoder)  # as make_ckpt: activations O(1), waveform off the clamp
    codec.to(torch.float32).save_pretrained(out / "speech_tokenizer", safe_serialization=True)


def make_checkpoint(out: Path, geometry: str):
    build_checkpoint(out, model_type="base", seed=SEED, tokenizer_dir=REPO / "tests" / "fixtures" / "tokenizer",
                     link_tokenizer=geometry == "tiny", codec_seed=CODEC_SEED, **GEOMETRY[geometry])
    if geometry == "tiny":
        rebuild_tiny_codec(out)


def official_mel(samples: np.ndarray) -> torch.Tensor:
    # the exact call of Qwen3TTSForConditionalGeneration.extract_speaker_embedding
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    return mel_spectrogram(torch.from_numpy(samples).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                           hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)[0]


def dump_reference(tts, out: Path, clip: str):
    """What create_voice_clone_prompt computes from a clip, plus the mel it goes through."""
    import librosa
    from safetensors.torch import save_file

    path = out / "audio" / f"{clip}.wav"
    items = tts.create_voice_clone_prompt(ref_audio=str(path), ref_text=REF_TEXT, x_vector_only_mode=False)
    samples, sr = librosa.load(str(path), sr=None, mono=True)  # the wrapper's loader
    if sr != SR:
        samples = librosa.resample(y=samples, orig_sr=sr, target_sr=SR)
    tensors = {"samples": torch.from_numpy(samples.astype(np.float32)).contiguous(),
               "mel": official_mel(samples).float().contiguous(),
               "x_vector": items[0].ref_spk_embedding.float().cpu().contiguous(),
               "ref_codes": items[0].ref_code.cpu().to(torch.int64).contiguous()}
    (out / "references").mkdir(exist_ok=True)
    save_file(tensors, str(out / "references" / f"{clip}.safetensors"))
    print(f"  {clip}: {samples.shape[0]} samples, mel {tuple(tensors['mel'].shape)}, "
          f"{tensors['ref_codes'].shape[0]} reference frames")
    return items


def dump_case(tts, out: Path, case: str, clip: str, mode: str, text_mode: str, max_new_tokens: int):
    from safetensors.torch import save_file

    items = tts.create_voice_clone_prompt(ref_audio=str(out / "audio" / f"{clip}.wav"), ref_text=REF_TEXT,
                                          x_vector_only_mode=mode == "base_xvector")
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=max_new_tokens)
    with Capture(tts) as cap:
        wavs, sr = tts.generate_voice_clone(text=TARGET, language="english", voice_clone_prompt=items,
                                            non_streaming_mode=text_mode == "whole", **greedy)
    assert sr == SR
    codes = cap.codes[0].cpu().to(torch.int64)
    wav = torch.from_numpy(wavs[0]).to(torch.float32)
    check_unclamped(case, wav)
    sampled = cap.talker_result.sequences[0].tolist()
    eos = tts.model.config.talker_config.codec_eos_token_id
    prefill = cap.talker_kwargs["inputs_embeds"][0].float().cpu()
    ref_ids = tts._tokenize_texts([tts._build_ref_text(REF_TEXT)])[0][0][3:-2].tolist()
    meta = {"mode": mode, "reference": clip, "text": TARGET, "ref_text": REF_TEXT, "language": "english",
            "text_mode": text_mode, "text_ids": text_ids(tts, TARGET),
            "ref_text_ids": ref_ids if mode == "base_icl" else None, "max_new_tokens": max_new_tokens,
            "prefill_len": prefill.shape[0], "num_frames": codes.shape[0],
            "finished_by": "eos" if sampled and sampled[-1] == eos else "max_new_tokens",
            "wav_len": wav.shape[0]}
    (out / "cases").mkdir(exist_ok=True)
    save_file({"prefill_embeds": prefill.contiguous(), "codes": codes.contiguous(), "wav": wav.contiguous()},
              str(out / "cases" / f"{case}.safetensors"))
    with open(out / "cases" / f"{case}.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"  {case}: prefill {meta['prefill_len']}, {meta['num_frames']} frames, wav {meta['wav_len']}")


def dump_resampled(tts, out: Path):
    """Official codes of the other renderings of ref_a, through librosa's soxr_hq resampling."""
    import librosa
    from safetensors.torch import save_file

    tensors = {}
    for name in ("ref_a_44k_stereo", "ref_a_16k"):
        samples, sr = librosa.load(str(out / "audio" / f"{name}.wav"), sr=None, mono=True)
        resampled = librosa.resample(y=samples, orig_sr=sr, target_sr=SR)
        codes = tts.model.speech_tokenizer.encode(samples, sr=sr).audio_codes[0]
        tensors[f"{name}.samples"] = torch.from_numpy(resampled.astype(np.float32)).contiguous()
        tensors[f"{name}.ref_codes"] = codes.cpu().to(torch.int64).contiguous()
        print(f"  {name}: {sr} Hz -> {resampled.shape[0]} samples, {codes.shape[0]} frames")
    save_file(tensors, str(out / "references" / "resampled.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--geometry", default="tiny", choices=list(GEOMETRY))
    ap.add_argument("--reuse", action="store_true", help="keep the checkpoint, redo audio and cases")
    args = ap.parse_args()

    set_float32_numerics()
    torch.manual_seed(0)
    out = Path(args.out)
    if not (args.reuse and (out / "model.safetensors").exists()):
        make_checkpoint(out, args.geometry)
    write_audio(out, args.geometry)
    tts = load_official(out, "cpu", "sdpa")
    max_new = MAX_NEW_TOKENS[args.geometry]
    for clip in CLIPS[args.geometry]:
        dump_reference(tts, out, clip)
    dump_resampled(tts, out)
    dump_case(tts, out, "icl_whole", "ref_a", "base_icl", "whole", max_new)
    dump_case(tts, out, "icl_streaming", "ref_a", "base_icl", "streaming", max_new)
    dump_case(tts, out, "xvector_streaming", "ref_a", "base_xvector", "streaming", max_new)
    if "ref_b" in CLIPS[args.geometry]:
        dump_case(tts, out, "icl_streaming_short_ref", "ref_b", "base_icl", "streaming", max_new)


if __name__ == "__main__":
    main()
