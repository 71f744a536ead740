#!/usr/bin/env python3
"""A random speech tokenizer *decoder* in the official layout (speech_tokenizer/config.json and
model.safetensors), for the CUDA codec benchmark: only the `decoder.*` tensors that decoding
reads, drawn with the randomisation of /work/shared/refcheck/make_ckpt.py (norm weights near 1,
small biases, layer scales, SnakeBeta parameters; residual branches and the final conv then scaled
as make_ckpt.py's condition_codec_decoder does, so activations stay O(1) and the waveform stays off
the clamp). Needs numpy and safetensors only, so it runs in seconds where the full
make_ckpt.py builds the whole 0.6B model first.
"""
import argparse
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# the values of scripts/parity/make_ckpt.py, which documents why (this script needs no torch)
CODEC_RESIDUAL_BRANCH_SCALE = 0.25
CODEC_OUTPUT_CONV_SCALE = 0.25

FULL = dict(latent_dim=1024, codebook_dim=512, codebook_size=2048, decoder_dim=1536, hidden_size=512,
            intermediate_size=1024, hidden_act="silu", num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=16, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000,
            max_position_embeddings=8000, sliding_window=72, layer_scale_initial_scale=0.01,
            num_quantizers=16, num_semantic_quantizers=1, semantic_codebook_size=4096,
            vector_quantization_hidden_dimension=512, upsample_rates=[8, 5, 4, 3],
            upsampling_ratios=[2, 2], attention_bias=False)
TINY = dict(FULL, latent_dim=64, codebook_dim=16, decoder_dim=48, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
            vector_quantization_hidden_dimension=32)


def shapes(d):
    """(name, shape) of every tensor the decoder reads, official names."""
    half, dim, size = d["codebook_dim"] // 2, d["codebook_dim"], d["codebook_size"]
    for rvq, layers in (("rvq_first", 1), ("rvq_rest", d["num_quantizers"] - 1)):
        q = f"decoder.quantizer.{rvq}"
        yield f"{q}.output_proj.weight", (dim, half, 1)
        for l in range(layers):
            yield f"{q}.vq.layers.{l}._codebook.embedding_sum", (size, half)
            yield f"{q}.vq.layers.{l}._codebook.cluster_usage", (size,)
    lat, h, inter = d["latent_dim"], d["hidden_size"], d["intermediate_size"]
    width = d["num_attention_heads"] * d["head_dim"]
    yield "decoder.pre_conv.conv.weight", (lat, dim, 3)
    yield "decoder.pre_conv.conv.bias", (lat,)
    t = "decoder.pre_transformer"
    yield f"{t}.input_proj.weight", (h, lat)
    yield f"{t}.input_proj.bias", (h,)
    for i in range(d["num_hidden_layers"]):
        l = f"{t}.layers.{i}"
        yield f"{l}.input_layernorm.weight", (h,)
        for p in ("q_proj", "k_proj", "v_proj"):
            yield f"{l}.self_attn.{p}.weight", (width, h)
        yield f"{l}.self_attn.o_proj.weight", (h, width)
        yield f"{l}.self_attn_layer_scale.scale", (h,)
        yield f"{l}.post_attention_layernorm.weight", (h,)
        yield f"{l}.mlp.gate_proj.weight", (inter, h)
        yield f"{l}.mlp.up_proj.weight", (inter, h)
        yield f"{l}.mlp.down_proj.weight", (h, inter)
        yield f"{l}.mlp_layer_scale.scale", (h,)
    yield f"{t}.norm.weight", (h,)
    yield f"{t}.output_proj.weight", (lat, h)
    yield f"{t}.output_proj.bias", (lat,)
    for i, f in enumerate(d["upsampling_ratios"]):
        u = f"decoder.upsample.{i}"
        yield f"{u}.0.conv.weight", (lat, lat, f)
        yield f"{u}.0.conv.bias", (lat,)
        yield f"{u}.1.dwconv.conv.weight", (lat, 1, 7)
        yield f"{u}.1.dwconv.conv.bias", (lat,)
        yield f"{u}.1.norm.weight", (lat,)
        yield f"{u}.1.norm.bias", (lat,)
        yield f"{u}.1.pwconv1.weight", (4 * lat, lat)
        yield f"{u}.1.pwconv1.bias", (4 * lat,)
        yield f"{u}.1.pwconv2.weight", (lat, 4 * lat)
        yield f"{u}.1.pwconv2.bias", (lat,)
        yield f"{u}.1.gamma", (lat,)
    dd = d["decoder_dim"]
    yield "decoder.decoder.0.conv.weight", (dd, lat, 7)
    yield "decoder.decoder.0.conv.bias", (dd,)
    for b, r in enumerate(d["upsample_rates"]):
        inp, out = dd >> b, dd >> (b + 1)
        k = f"decoder.decoder.{b + 1}.block"
        yield f"{k}.0.alpha", (inp,)
        yield f"{k}.0.beta", (inp,)
        yield f"{k}.1.conv.weight", (inp, out, 2 * r)
        yield f"{k}.1.conv.bias", (out,)
        for u in range(3):
            n = f"{k}.{u + 2}"
            for a in ("act1", "act2"):
                yield f"{n}.{a}.alpha", (out,)
                yield f"{n}.{a}.beta", (out,)
            yield f"{n}.conv1.conv.weight", (out, out, 7)
            yield f"{n}.conv1.conv.bias", (out,)
            yield f"{n}.conv2.conv.weight", (out, out, 1)
            yield f"{n}.conv2.conv.bias", (out,)
    blocks = len(d["upsample_rates"])
    last = dd >> blocks
    yield f"decoder.decoder.{blocks + 1}.alpha", (last,)
    yield f"decoder.decoder.{blocks + 1}.beta", (last,)
    yield f"decoder.decoder.{blocks + 2}.conv.weight", (1, last, 7)
    yield f"decoder.decoder.{blocks + 2}.conv.bias", (1,)


def value(name, shape, rng):
    """make_ckpt.py's `randomise` rule for this parameter."""
    leaf = name.rsplit(".", 1)[-1]
    if "cluster_usage" in name:
        return rng.random(shape, dtype=np.float32) + 0.5
    if "embedding_sum" in name:
        return rng.standard_normal(shape, dtype=np.float32)
    if leaf in ("alpha", "beta"):
        return rng.standard_normal(shape, dtype=np.float32) * 0.3
    if "scale" in name or leaf == "gamma":
        return 0.05 + 0.1 * rng.random(shape, dtype=np.float32)
    if len(shape) == 1 and leaf == "weight":
        return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    if leaf == "bias":
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)
    fan_in = math.prod(shape[1:])
    return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(fan_in))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="directory; writes OUT/speech_tokenizer/")
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--encoder-config", required=True,
                    help="the released speech tokenizer config.json, whose encoder_config is kept "
                         "(the encoder's weights are not drawn, but loading reads its config)")
    args = ap.parse_args()
    d = FULL if args.size == "0.6b" else TINY
    rng = np.random.default_rng(args.seed)
    tensors = {name: value(name, shape, rng).astype(np.float32) for name, shape in shapes(d)}
    # make_ckpt.py's condition_codec_decoder: residual branches and the final conv scaled so the
    # activations stay O(1) like a trained codec and the waveform stays inside (-1, 1)
    blocks = len(d["upsample_rates"])
    for leaf in ("weight", "bias"):
        for block in range(1, blocks + 1):
            for unit in (2, 3, 4):  # block.0 is SnakeBeta, block.1 the transposed conv
                tensors[f"decoder.decoder.{block}.block.{unit}.conv2.conv.{leaf}"] *= np.float32(
                    CODEC_RESIDUAL_BRANCH_SCALE)
        tensors[f"decoder.decoder.{blocks + 2}.conv.{leaf}"] *= np.float32(CODEC_OUTPUT_CONV_SCALE)
    out = Path(args.out) / "speech_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"model_type": "qwen3_tts_tokenizer_12hz", "encoder_valid_num_quantizers": 16,
              "input_sample_rate": 24000, "output_sample_rate": 24000, "decode_upsample_rate": 1920,
              "encode_downsample_rate": 1920, "decoder_config": d,
              "encoder_config": json.load(open(args.encoder_config))["encoder_config"]}
    json.dump(config, open(out / "config.json", "w"), indent=2)
    n = sum(t.size for t in tensors.values())
    print(f"speech tokenizer decoder {out}: {args.size}, {n / 1e6:.1f} M params")


if __name__ == "__main__":
    main()
