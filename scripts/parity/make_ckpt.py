#!/usr/bin/env python3
"""Build a random-weight Qwen3-TTS checkpoint in the official Hugging Face layout,
using the official qwen-tts 0.1.1 classes (needs transformers 4.57.3).

Copied from /work/shared/refcheck/make_ckpt.py and extended for the parity fixtures:
--text-hidden shrinks the 151936-row text table, --predictor-hidden sets the code
predictor width (64 == tiny talker width gives the 0.6B-like layout without
small_to_mtp_projection), --link-tokenizer writes relative symlinks instead of copies,
and the codec gets its own generator so that every checkpoint with the same seed
shares one byte-identical speech tokenizer.

Every parameter is randomised (norm weights near 1, biases, layer scales and
SnakeBeta parameters included) so that a re-implementation that drops or
misplaces any tensor produces different codes; the codec decoder's residual branches
and final conv are then scaled down so its activations stay O(1), as in a trained
codec (condition_codec_decoder).  --no-eos zeroes the codec_head row of codec EOS so
that generation always runs to max_new_tokens (benchmarks).
"""
import argparse
import json
import math
import os
import shutil
from pathlib import Path

import torch

# The lead's reference folder holds the verbatim 0.6B-Base config and the tokenizer files.
REFERENCE = Path("/work/shared/reference")

SPEAKERS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875,
            "ryan": 3061, "aiden": 2861, "ono_anna": 2873, "sohee": 2864}
DIALECT = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}

SPEECH_TOKENIZER = {
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16, "input_sample_rate": 24000, "output_sample_rate": 24000,
    "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
    "decoder_config": dict(latent_dim=1024, codebook_dim=512, codebook_size=2048, decoder_dim=1536,
                           hidden_size=512, intermediate_size=1024, hidden_act="silu", num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=16, head_dim=64, rms_norm_eps=1e-5,
                           rope_theta=10000, max_position_embeddings=8000, sliding_window=72,
                           layer_scale_initial_scale=0.01, num_quantizers=16, num_semantic_quantizers=1,
                           semantic_codebook_size=4096, vector_quantization_hidden_dimension=512,
                           upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], attention_bias=False),
    "encoder_config": dict(_frame_rate=12.5, sampling_rate=24000, audio_channels=1, hidden_size=512,
                           num_filters=64, upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3,
                           residual_kernel_size=3, dilation_growth_rate=2, compress=2, num_residual_layers=1,
                           use_causal_conv=True, pad_mode="constant", use_conv_shortcut=False,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                           intermediate_size=2048, hidden_act="gelu", norm_eps=1e-5, rope_theta=10000,
                           sliding_window=250, layer_scale_initial_scale=0.01, max_position_embeddings=8000,
                           codebook_size=2048, codebook_dim=256, num_quantizers=32, num_semantic_quantizers=1,
                           vector_quantization_hidden_dimension=256, upsample_groups=512, trim_right_ratio=1.0),
}

TINY_TALKER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=96, text_hidden_size=32)
TINY_PREDICTOR = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=80)
TINY_SPEAKER_ENCODER = dict(enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16)
TINY_ENCODER = dict(hidden_size=32, num_filters=8, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=8, intermediate_size=64, codebook_dim=8,
                    vector_quantization_hidden_dimension=16, upsample_groups=32)
TINY_DECODER = dict(latent_dim=64, codebook_dim=16, decoder_dim=48, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                    vector_quantization_hidden_dimension=32)


def randomise(model: torch.nn.Module, gen: torch.Generator):
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            shape = tuple(p.shape)
            if "cluster_usage" in name:
                v = torch.rand(shape, generator=gen) + 0.5
            elif "embedding_sum" in name:
                v = torch.randn(shape, generator=gen)
            elif leaf in ("alpha", "beta"):                       # SnakeBeta, log-parameterised
                v = torch.randn(shape, generator=gen) * 0.3
            elif "scale" in name or leaf == "gamma":            # layer scales
                v = 0.05 + 0.1 * torch.rand(shape, generator=gen)
            elif p.dim() == 1 and leaf == "weight":               # RMSNorm / LayerNorm weights
                v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif leaf == "bias":
                v = 0.02 * torch.randn(shape, generator=gen)
            else:                                                  # matrices, convs, embeddings
                fan_in = p[0].numel() if p.dim() > 1 else 1
                std = min(0.02, 1.0 / math.sqrt(max(fan_in, 1))) if "embed" in name else 1.0 / math.sqrt(max(fan_in, 1))
                v = torch.randn(shape, generator=gen) * std
            p.copy_(v.to(p.dtype))


# Residual-unit branches of the codec decoder are scaled so each unit adds a small correction to its
# input, as in a trained vocoder. Unscaled, each of the 12 units (3 per block, 4 blocks) roughly
# doubles the signal and the last SnakeBeta sees amplitudes near 250: f32 rounding of sin(x * alpha)
# there alone moved the official f32 decode 1.8e-4 from f64, above the 1e-4 waveform parity bar.
# With 0.25 the activations after the transformer stay below ~5 (tiny and full size) and the official
# f32 decode is ~1e-6 from f64 (scripts/parity/codec_precision.py).
CODEC_RESIDUAL_BRANCH_SCALE = 0.25
# The final conv then yields |wav| up to ~0.7 on random codes: off the [-1, 1] clamp, which would
# hide decoder errors, but still a full-scale signal.
CODEC_OUTPUT_CONV_SCALE = 0.25


def condition_codec_decoder(decoder: torch.nn.Module):
    """Scale (never zero) random decoder weights so activations stay O(1), like a trained codec."""
    with torch.no_grad():
        # the residual unit's k=1 conv is the last op of its branch
        branches = [m.conv for name, m in decoder.decoder.named_modules() if name.endswith(".conv2")]
        if len(branches) != 3 * len(decoder.config.upsample_rates):  # dilations 1, 3, 9 per block
            raise RuntimeError(f"expected 3 residual units per decoder block, found {len(branches)} in all")
        for conv in branches:
            conv.weight.mul_(CODEC_RESIDUAL_BRANCH_SCALE)
            conv.bias.mul_(CODEC_RESIDUAL_BRANCH_SCALE)
        last = decoder.decoder[-1].conv
        last.weight.mul_(CODEC_OUTPUT_CONV_SCALE)
        last.bias.mul_(CODEC_OUTPUT_CONV_SCALE)


def build_config(size, model_type, text_hidden=None, predictor_hidden=None, talker_hidden=None,
                 reference=REFERENCE):
    cfg = json.load(open(Path(reference) / "checkpoints" / "qwen3-tts-12hz-0.6b-base.config.json"))
    cfg["tts_model_type"] = model_type
    tc = cfg["talker_config"]
    if model_type == "custom_voice":
        tc["spk_id"] = dict(SPEAKERS)
        tc["spk_is_dialect"] = {k: DIALECT.get(k, False) for k in SPEAKERS}
        tc["codec_language_id"].update(beijing_dialect=2074, sichuan_dialect=2062)
    if size == "1.7b":
        tc.update(hidden_size=2048, intermediate_size=6144)
        cfg["tts_model_size"] = "1b7"
    if size == "tiny":
        tc.update(TINY_TALKER)
        tc["code_predictor_config"].update(TINY_PREDICTOR)
        cfg["speaker_encoder_config"].update(TINY_SPEAKER_ENCODER)
    if talker_hidden is not None:
        tc["hidden_size"] = talker_hidden
    # the x-vector is inserted as a talker codec row, so it has the talker width
    cfg["speaker_encoder_config"]["enc_dim"] = tc["hidden_size"]
    if text_hidden is not None:
        tc["text_hidden_size"] = text_hidden
    if predictor_hidden is not None:
        tc["code_predictor_config"]["hidden_size"] = predictor_hidden
    st = json.loads(json.dumps(SPEECH_TOKENIZER))
    if size == "tiny":
        st["decoder_config"].update(TINY_DECODER)
        st["encoder_config"].update(TINY_ENCODER)
    return cfg, st


def write_tokenizer_files(out: Path, tokenizer_dir: Path, link: bool):
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        dst = out / f
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if link:
            dst.symlink_to(os.path.relpath(Path(tokenizer_dir).resolve() / f, out.resolve()))
        else:
            shutil.copy(Path(tokenizer_dir) / f, dst)


def build_checkpoint(out, size="tiny", model_type="custom_voice", seed=0, no_eos=False, text_hidden=None,
                     predictor_hidden=None, talker_hidden=None, tokenizer_dir=None, link_tokenizer=False,
                     reference=REFERENCE, codec_seed=None, eos_scale=None):
    from official import ensure_qwen_tts_importable
    ensure_qwen_tts_importable()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, st = build_config(size, model_type, text_hidden, predictor_hidden, talker_hidden, reference)
    tc = cfg["talker_config"]

    gen = torch.Generator().manual_seed(seed)
    config = Qwen3TTSConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    model = Qwen3TTSForConditionalGeneration(config)
    randomise(model, gen)
    if no_eos:
        with torch.no_grad():
            model.talker.codec_head.weight[tc["codec_eos_token_id"]].zero_()
    if eos_scale is not None:
        # random weights almost never pick EOS; a power of two keeps the bf16 rounding of the row unchanged
        with torch.no_grad():
            model.talker.codec_head.weight[tc["codec_eos_token_id"]].mul_(eos_scale)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained rewrites config.json with extra keys the loader rejects; write the released form
    json.dump(cfg, open(out / "config.json", "w"), indent=2)

    # a generator of its own: the codec does not depend on the talker geometry
    codec_gen = torch.Generator().manual_seed(seed + 1000 if codec_seed is None else codec_seed)
    stc = Qwen3TTSTokenizerV2Config(**{k: v for k, v in st.items() if k != "model_type"})
    codec = Qwen3TTSTokenizerV2Model(stc)
    randomise(codec, codec_gen)
    condition_codec_decoder(codec.decoder)
    (out / "speech_tokenizer").mkdir(exist_ok=True)
    codec.to(torch.float32).save_pretrained(out / "speech_tokenizer", safe_serialization=True)
    json.dump({"chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
               "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
               "sampling_rate": 24000}, open(out / "speech_tokenizer" / "preprocessor_config.json", "w"), indent=2)

    write_tokenizer_files(out, tokenizer_dir or Path(reference) / "tokenizer", link_tokenizer)
    json.dump({"padding_side": "left", "padding_value": 0.0, "processor_class": "Qwen3TTSProcessor",
               "return_attention_mask": True}, open(out / "preprocessor_config.json", "w"), indent=2)
    json.dump({"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
               "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
               "subtalker_top_k": 50, "max_new_tokens": 8192}, open(out / "generation_config.json", "w"), indent=2)
    n = sum(p.numel() for p in model.parameters())
    print(f"checkpoint {out}: {size} {model_type}, {n/1e6:.2f} M talker-side params")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b", "tiny"])
    ap.add_argument("--type", default="custom_voice", choices=["custom_voice", "base", "voice_design"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-eos", action="store_true")
    ap.add_argument("--eos-scale", type=float, help="multiply the codec_head EOS row (makes EOS likelier)")
    ap.add_argument("--text-hidden", type=int, help="talker text_hidden_size (text table width)")
    ap.add_argument("--predictor-hidden", type=int, help="code predictor hidden_size")
    ap.add_argument("--talker-hidden", type=int, help="talker hidden_size (also the x-vector width)")
    ap.add_argument("--reference", default=str(REFERENCE), help="folder with checkpoints/ and tokenizer/")
    ap.add_argument("--tokenizer-dir", help="folder with vocab.json, merges.txt, tokenizer_config.json")
    ap.add_argument("--link-tokenizer", action="store_true", help="relative symlinks instead of copies")
    ap.add_argument("--config-only", action="store_true", help="rewrite config.json only")
    args = ap.parse_args()

    if args.config_only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        cfg, _ = build_config(args.size, args.type, args.text_hidden, args.predictor_hidden, args.talker_hidden,
                              args.reference)
        json.dump(cfg, open(out / "config.json", "w"), indent=2)
        return
    build_checkpoint(args.out, args.size, args.type, args.seed, args.no_eos, args.text_hidden,
                     args.predictor_hidden, args.talker_hidden, args.tokenizer_dir, args.link_tokenizer,
                     args.reference, eos_scale=args.eos_scale)


if __name__ == "__main__":
    main()
