#!/usr/bin/env python3
"""Build the parity fixtures: tiny random Qwen3-TTS checkpoints plus the official outputs for a set of
requests, dumped from the official qwen-tts 0.1.1 wrapper (greedy, float32, TF32 off).

Layout and meaning of every file: /work/briefs/fixtures.md and scripts/parity/README.md.

    /work/refenv/bin/python scripts/parity/make_fixtures.py --out tests/fixtures/parity
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from make_ckpt import REFERENCE, build_checkpoint  # noqa: E402
from official import ensure_qwen_tts_importable  # noqa: E402

SAMPLES_PER_FRAME = 1920
CODEC_SEED = 1000  # one codec for every fixture checkpoint, stored once and symlinked
SHARED_CODEC_OWNER = "tiny-custom-voice"
LOGIT_STEPS = 8
DECODER_LONG_FRAMES = 90  # beyond the codec transformer's 72-frame sliding window, below the 300-frame chunk

# Tiny geometry for committed fixtures: the talker is 16 wide (q width 64 != hidden, as in the real models),
# the predictor 8 wide (so small_to_mtp_projection exists, as in the 1.7B) except in the same-width
# checkpoint (no projection, as in the 0.6B), and the 151936-row text table is 4 wide to keep files small.
FIXTURE_GEOMETRY = dict(size="tiny", text_hidden=4, talker_hidden=16, predictor_hidden=8)
FULL_GEOMETRY = {"0.6b": dict(size="0.6b", talker_hidden=1024), "1.7b": dict(size="1.7b", talker_hidden=2048)}

HELLO = "Hello world, this is a test."
NIHAO = "你好，世界。"
MIXED = "Hello 你好, this is test 42."
DESIGN = "A calm, deep male voice, speaking slowly and clearly."
STYLE = "Speak happily, a little faster than usual."
# mixed-case words and 's+letters split differently under the Mistral regex that fix_mistral_regex=True
# installs for local checkpoint folders (spec 3.1); its text_ids pin the official behaviour
MIXED_CASE = "My iPhone's OpenAI app says 'sup."

CHECKPOINTS = {
    # labelled 1b7 (it has the 1.7B-like small_to_mtp_projection): the wrapper drops instruct for 0b6 only
    "tiny-custom-voice": dict(model_type="custom_voice", seed=1, tts_model_size="1b7"),
    # EOS row doubled: both cases then end by EOS (frame 15), the others run to max_new_tokens
    "tiny-voice-design": dict(model_type="voice_design", seed=2, eos_scale=2.0),
    "tiny-base": dict(model_type="base", seed=3),
    "tiny-custom-voice-same-width": dict(model_type="custom_voice", seed=4, same_width=True),
}

# (case name, mode, request); text_mode "whole" is official non_streaming_mode=True
CASES = {
    "tiny-custom-voice": [
        ("ryan_english_whole", dict(text=HELLO, language="english", speaker="ryan", text_mode="whole")),
        ("ryan_english_streaming", dict(text=HELLO, language="english", speaker="ryan", text_mode="streaming")),
        ("vivian_auto_whole", dict(text=MIXED, language="auto", speaker="vivian", text_mode="whole")),
        ("dylan_chinese_whole", dict(text=NIHAO, language="chinese", speaker="dylan", text_mode="whole")),
        ("eric_auto_streaming", dict(text=NIHAO, language="auto", speaker="eric", text_mode="streaming")),
        ("ryan_english_instruct_whole", dict(text=HELLO, language="english", speaker="ryan", instruct=STYLE,
                                             text_mode="whole")),
        ("aiden_auto_instruct_streaming", dict(text=MIXED, language="auto", speaker="aiden", instruct=STYLE,
                                               text_mode="streaming")),
    ],
    "tiny-voice-design": [
        ("design_english_whole", dict(text=HELLO, language="english", instruct=DESIGN, text_mode="whole")),
        ("design_auto_streaming", dict(text=MIXED, language="auto", instruct=DESIGN, text_mode="streaming")),
    ],
    "tiny-base": [
        ("xvector_english_whole", dict(text=HELLO, language="english", text_mode="whole")),
        ("xvector_chinese_streaming", dict(text=NIHAO, language="chinese", text_mode="streaming")),
    ],
    "tiny-custom-voice-same-width": [
        ("ryan_english_whole", dict(text=HELLO, language="english", speaker="ryan", text_mode="whole")),
        ("serena_auto_streaming", dict(text=MIXED, language="auto", speaker="serena", text_mode="streaming")),
        ("aiden_english_mixed_case_whole", dict(text=MIXED_CASE, language="english", speaker="aiden",
                                                text_mode="whole")),
    ],
}
MODES = {"custom_voice": "custom_voice", "voice_design": "voice_design", "base": "base_xvector"}


def set_float32_numerics():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def make_checkpoint(out_dir: Path, name: str, spec: dict, geometry: dict, tokenizer_dir: Path, reference: Path):
    geometry = dict(geometry)
    if spec.get("same_width"):
        geometry["predictor_hidden"] = geometry["talker_hidden"]
    shared_codec = out_dir / name / "speech_tokenizer" / "model.safetensors"
    if shared_codec.is_symlink():  # never write through the link into the shared copy
        shared_codec.unlink()
    build_checkpoint(out_dir / name, model_type=spec["model_type"], seed=spec["seed"], tokenizer_dir=tokenizer_dir,
                     link_tokenizer=True, reference=reference, codec_seed=CODEC_SEED,
                     eos_scale=spec.get("eos_scale"), **geometry)
    if "tts_model_size" in spec:
        config_path = out_dir / name / "config.json"
        config = json.loads(config_path.read_text())
        config["tts_model_size"] = spec["tts_model_size"]
        config_path.write_text(json.dumps(config, indent=2))


def share_codec(out_dir: Path, names):
    """Replace byte-identical codec weights by relative symlinks to one copy."""
    owner = out_dir / SHARED_CODEC_OWNER / "speech_tokenizer" / "model.safetensors"
    for name in names:
        path = out_dir / name / "speech_tokenizer" / "model.safetensors"
        if name == SHARED_CODEC_OWNER or not owner.exists() or path.is_symlink():
            continue
        if path.read_bytes() != owner.read_bytes():
            raise RuntimeError(f"{path} differs from {owner}; codec weights must be shared")
        path.unlink()
        path.symlink_to(os.path.relpath(owner, path.parent))


class Capture:
    """Hooks the official model to record what the wrapper feeds the talker and what comes out."""

    def __init__(self, tts):
        self.tts = tts
        self.talker = tts.model.talker
        self.logits = []
        self.talker_kwargs = None
        self.talker_result = None
        self.codes = None

    def __enter__(self):
        talker_generate = self.talker.generate
        model_generate = self.tts.model.generate

        def capture_talker_generate(*args, **kwargs):
            self.talker_kwargs = kwargs
            self.talker_result = talker_generate(*args, **kwargs)
            return self.talker_result

        def capture_model_generate(*args, **kwargs):
            codes, hiddens = model_generate(*args, **kwargs)
            self.codes = codes
            return codes, hiddens

        # the last position of each codec_head call gives the next codebook-0 logits (raw, before processors)
        self.hook = self.talker.codec_head.register_forward_hook(
            lambda _m, _i, out: self.logits.append(out[0, -1].detach().float().cpu().clone()))
        self.talker.generate = capture_talker_generate
        self.tts.model.generate = capture_model_generate
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        del self.talker.generate
        del self.tts.model.generate


def text_ids(tts, text):
    ids = tts._tokenize_texts([tts._build_assistant_text(text)])[0][0]
    return ids[3:-5].tolist()


def instruct_ids(tts, instruct):
    if not instruct:
        return None
    return tts._tokenize_texts([tts._build_instruct_text(instruct)])[0][0].tolist()


def fixed_xvector(width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # bf16-representable values, so a bf16 engine receives exactly the vector the official run used
    return (torch.randn(width, generator=gen) * 0.02).to(torch.bfloat16).to(torch.float32)


def run_case(tts, model_type: str, request: dict, max_new_tokens: int, xvector_seed: int):
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=max_new_tokens)
    non_streaming = request["text_mode"] == "whole"
    speaker_vector = None
    with Capture(tts) as cap:
        if model_type == "custom_voice":
            wavs, sr = tts.generate_custom_voice(text=request["text"], speaker=request["speaker"],
                                                 language=request["language"], instruct=request.get("instruct"),
                                                 non_streaming_mode=non_streaming, **greedy)
        elif model_type == "voice_design":
            wavs, sr = tts.generate_voice_design(text=request["text"], instruct=request["instruct"],
                                                 language=request["language"], non_streaming_mode=non_streaming,
                                                 **greedy)
        else:
            width = tts.model.config.talker_config.hidden_size
            speaker_vector = fixed_xvector(width, xvector_seed).to(tts.device)
            # the dict form of voice_clone_prompt, as the wrapper builds it from audio, with our x-vector
            prompt = dict(ref_code=[None], ref_spk_embedding=[speaker_vector], x_vector_only_mode=[True],
                          icl_mode=[False])
            wavs, sr = tts.generate_voice_clone(text=request["text"], language=request["language"],
                                                voice_clone_prompt=prompt, non_streaming_mode=non_streaming,
                                                **greedy)
    assert sr == 24000, sr
    return cap, wavs[0], speaker_vector


def trailing_rows(cap):
    trailing = cap.talker_kwargs["trailing_text_hidden"][0].float().cpu()
    tts_pad = cap.talker_kwargs["tts_pad_embed"].reshape(1, -1).float().cpu()
    # streaming mode ends with tts_eos; append tts_pad so the last row is always the vector used after the end
    if not torch.equal(trailing[-1:], tts_pad):
        trailing = torch.cat([trailing, tts_pad])
    return trailing


def check_unclamped(name: str, wav: torch.Tensor):
    # the codec clamps to [-1, 1]; a clamped fixture would hide decoder errors
    if wav.abs().max() >= 1.0:
        raise RuntimeError(f"{name}: waveform reaches the clamp (max |x| = {wav.abs().max():.3f})")


def dump_case(tts, ckpt_dir: Path, case: str, model_type: str, request: dict, max_new_tokens: int, seed: int):
    from safetensors.torch import save_file

    cap, wav, speaker_vector = run_case(tts, model_type, request, max_new_tokens, seed)
    codes = cap.codes[0].cpu().to(torch.int64)
    frames = codes.shape[0]
    eos = tts.model.config.talker_config.codec_eos_token_id
    sampled = cap.talker_result.sequences[0].tolist()
    finished_by = "eos" if sampled and sampled[-1] == eos else "max_new_tokens"
    prefill = cap.talker_kwargs["inputs_embeds"][0].float().cpu()
    wav = torch.from_numpy(wav).to(torch.float32)
    if wav.shape[0] != frames * SAMPLES_PER_FRAME:
        raise RuntimeError(f"{case}: wav has {wav.shape[0]} samples for {frames} frames")
    check_unclamped(case, wav)
    if len(cap.logits) != len(sampled):
        raise RuntimeError(f"{case}: {len(cap.logits)} codec_head calls for {len(sampled)} sampled tokens")
    logits = torch.stack(cap.logits[:LOGIT_STEPS])

    tensors = {"prefill_embeds": prefill.contiguous(), "trailing_embeds": trailing_rows(cap).contiguous(),
               "logits_c0": logits.contiguous(), "codes": codes.contiguous(), "wav": wav.contiguous()}
    if speaker_vector is not None:
        tensors["speaker_vector"] = speaker_vector.float().cpu().contiguous()
    meta = {
        "mode": MODES[model_type],
        "text": request["text"],
        "language": request["language"],
        "speaker": request.get("speaker"),
        "instruct": request.get("instruct"),
        "text_mode": request["text_mode"],
        "text_ids": text_ids(tts, request["text"]),
        "instruct_ids": instruct_ids(tts, request.get("instruct")),
        "max_new_tokens": max_new_tokens,
        "prefill_len": prefill.shape[0],
        "num_frames": frames,
        "finished_by": finished_by,
        "logit_steps": logits.shape[0],
    }
    cases_dir = ckpt_dir / "cases"
    cases_dir.mkdir(exist_ok=True)
    save_file(tensors, str(cases_dir / f"{case}.safetensors"))
    with open(cases_dir / f"{case}.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"  {case}: prefill {meta['prefill_len']}, trailing {tensors['trailing_embeds'].shape[0]}, "
          f"{frames} frames, {finished_by}")


def dump_decoder_long(tts, ckpt_dir: Path):
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(90)
    codes = torch.randint(0, 2048, (DECODER_LONG_FRAMES, 16), generator=gen, dtype=torch.int64)
    wavs, _ = tts.model.speech_tokenizer.decode([{"audio_codes": codes.to(tts.device)}])
    wav = torch.from_numpy(wavs[0]).to(torch.float32)
    assert wav.shape[0] == DECODER_LONG_FRAMES * SAMPLES_PER_FRAME, wav.shape
    check_unclamped("decoder_long", wav)
    (ckpt_dir / "cases").mkdir(exist_ok=True)
    save_file({"codes": codes, "wav": wav}, str(ckpt_dir / "cases" / "decoder_long.safetensors"))
    print(f"  decoder_long: {DECODER_LONG_FRAMES} frames")


def load_official(ckpt_dir: Path, device: str, attn: str):
    ensure_qwen_tts_importable()
    from qwen_tts import Qwen3TTSModel

    tts = Qwen3TTSModel.from_pretrained(str(ckpt_dir), dtype=torch.float32, attn_implementation=attn,
                                        device_map=device)
    tts.model.eval()
    return tts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="e.g. tests/fixtures/parity")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--geometry", default="fixture", choices=["fixture", *FULL_GEOMETRY],
                    help="fixture = the tiny committed checkpoints; 0.6b/1.7b = full-size random ones")
    ap.add_argument("--only", nargs="*", choices=list(CHECKPOINTS), help="checkpoints to build (default all)")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--reuse", action="store_true", help="keep existing checkpoint weights, only redo cases")
    ap.add_argument("--reference", default=str(REFERENCE), help="folder with checkpoints/*.config.json")
    ap.add_argument("--tokenizer-dir", default=str(REPO / "tests" / "fixtures" / "tokenizer"))
    args = ap.parse_args()

    set_float32_numerics()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    geometry = FIXTURE_GEOMETRY if args.geometry == "fixture" else FULL_GEOMETRY[args.geometry]
    names = args.only or list(CHECKPOINTS)
    for name in names:
        spec = CHECKPOINTS[name]
        ckpt_dir = out_dir / name
        if not (args.reuse and (ckpt_dir / "model.safetensors").exists()):
            make_checkpoint(out_dir, name, spec, geometry, Path(args.tokenizer_dir), Path(args.reference))
        print(f"{name}: dumping cases")
        tts = load_official(ckpt_dir, args.device, args.attn)
        for index, (case, request) in enumerate(CASES[name]):
            dump_case(tts, ckpt_dir, case, spec["model_type"], request, args.max_new_tokens, seed=100 + index)
        if name == SHARED_CODEC_OWNER:
            dump_decoder_long(tts, ckpt_dir)
        del tts
    share_codec(out_dir, names)


if __name__ == "__main__":
    main()
