#!/usr/bin/env python3
"""Check the prompt-plan snapshots against the official qwen-tts 0.1.1 code.

For every snapshot under crates/voxkernel-core/tests/snapshots/prompt_plan/, this builds a tiny
random model of the snapshot's variant with the official classes (same token and codec ids as
the real config, tiny widths), runs the official `Qwen3TTSForConditionalGeneration.generate` on
the snapshot's request up to the talker call, and compares the talker's prefill embeddings and
trailing text rows with the ones the snapshot's plan describes:
    row = TP(text_id) + {nothing | CE(id) | x-vector | FRAME(reference frame k)}.
Run with the reference venv:  /work/refenv/bin/python scripts/prompt/check_snapshots_official.py
"""
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SNAPSHOTS = REPO / "crates/voxkernel-core/tests/snapshots/prompt_plan"
CONFIG = REPO / "tests/fixtures/configs/0.6b-base.config.json"

SPEAKERS = {"vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875,
            "ryan": 3061, "aiden": 2861, "ono_anna": 2873, "sohee": 2864}
DIALECT = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
TINY_TALKER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=8, intermediate_size=32, text_hidden_size=8)
TINY_PREDICTOR = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, intermediate_size=32)
# The assistant chat string's tail after the text: <|im_end|> \n <|im_start|> assistant \n
TARGET_TAIL = [151645, 198, 151644, 77091, 198]
REF_HEAD = [151644, 77091, 198]
REF_TAIL = [151645, 198]


class Captured(Exception):
    pass


def import_qwen_tts():
    """qwen_tts imports torchaudio at package import for its (unreleased) 25 Hz tokenizer only;
    when torchaudio cannot load (a torch/torchaudio CUDA mismatch), stand in an empty module."""
    import importlib.machinery
    import types
    try:
        import torchaudio.compliance.kaldi  # noqa: F401
    except Exception:
        for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
        sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]


def build_model(variant):
    import_qwen_tts()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    model_type, size = variant.split("-")
    cfg = json.load(open(CONFIG))
    cfg["tts_model_type"] = model_type
    cfg["tts_model_size"] = size
    tc = cfg["talker_config"]
    if model_type == "custom_voice":
        tc["spk_id"] = dict(SPEAKERS)
        tc["spk_is_dialect"] = {k: DIALECT.get(k, False) for k in SPEAKERS}
        tc["codec_language_id"].update(beijing_dialect=2074, sichuan_dialect=2062)
    tc.update(TINY_TALKER)
    tc["code_predictor_config"].update(TINY_PREDICTOR)
    cfg["speaker_encoder_config"]["enc_dim"] = TINY_TALKER["hidden_size"]
    torch.manual_seed(0)
    config = Qwen3TTSConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    model = Qwen3TTSForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # make every text-projection bias and embedding row distinctive
        for p in model.talker.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model


def official_inputs(model, case):
    """Runs the official generate() until the talker call; returns (prefill, trailing, xvec)."""
    req = case["request"]
    target = torch.tensor([(req["target_role"] or REF_HEAD) + req["target"] + TARGET_TAIL])
    voice = req["voice"]
    kwargs = dict(input_ids=[target], languages=[req["language"]],
                  non_streaming_mode=req["text_mode"] == "whole")
    xvec = None
    if req["instruct"] is not None and model.tts_model_size != "0b6":
        # The wrapper drops the 0.6B CustomVoice instruct before generate(); mirror that.
        kwargs["instruct_ids"] = [torch.tensor([req["instruct"]])]
    if voice["kind"] == "speaker":
        kwargs["speakers"] = [voice["name"]]
    elif voice["kind"] in ("x_vector", "clone"):
        xvec = torch.randn(TINY_TALKER["hidden_size"])
        icl = voice["kind"] == "clone"
        kwargs["voice_clone_prompt"] = dict(
            ref_code=[torch.tensor(voice["reference_codes"]) if icl else None],
            ref_spk_embedding=[xvec], x_vector_only_mode=[not icl], icl_mode=[icl])
        if icl:
            kwargs["ref_ids"] = [torch.tensor([REF_HEAD + req["reference"] + REF_TAIL])]
    captured = {}

    def capture(**kw):
        captured.update(kw)
        raise Captured()

    model.talker.generate = capture
    try:
        model.generate(**kwargs, max_new_tokens=4, do_sample=False, subtalker_dosample=False)
    except Captured:
        pass
    return captured["inputs_embeds"][0], captured["trailing_text_hidden"][0], xvec


def plan_embeds(model, case, xvec):
    plan = case["plan"]
    talker = model.talker

    def tp(ids):
        return talker.text_projection(talker.get_text_embeddings()(torch.tensor(ids)))

    def ce(i):
        return talker.get_input_embeddings()(torch.tensor(i))

    frames = case["request"]["voice"].get("reference_codes", [])

    def codec(src):
        if src["kind"] == "none":
            return 0
        if src["kind"] == "id":
            return ce(src["value"])
        if src["kind"] == "speaker_vector":
            return xvec
        if src["kind"] == "reference_frame":
            frame = frames[src["value"]]
            emb = ce(frame[0])
            for g in range(1, 16):
                emb = emb + talker.code_predictor.get_input_embeddings()[g - 1](torch.tensor(frame[g]))
            return emb
        raise ValueError(src)

    rows = [tp(r["text_id"]) + codec(r["codec"]) for r in plan["prefill"]]
    trailing = [tp(t) for t in plan["trailing"]] or [tp(plan["tts_pad_id"])]
    return torch.stack(rows), torch.stack(trailing)


def main():
    failures = 0
    models = {}
    paths = sorted(SNAPSHOTS.glob("*.json"))
    if not paths:
        sys.exit(f"no snapshots under {SNAPSHOTS}")
    with torch.no_grad():
        for path in paths:
            case = json.load(open(path))
            variant = case["variant"]
            if variant not in models:
                models[variant] = build_model(variant)
            model = models[variant]
            prefill, trailing, xvec = official_inputs(model, case)
            mine_prefill, mine_trailing = plan_embeds(model, case, xvec)
            ok = prefill.shape == mine_prefill.shape and trailing.shape == mine_trailing.shape
            if ok:
                err = max((prefill - mine_prefill).abs().max().item(), (trailing - mine_trailing).abs().max().item())
                ok = err < 1e-4
            else:
                err = float("nan")
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {path.stem}: official prefill {tuple(prefill.shape)} trailing "
                  f"{tuple(trailing.shape)}; plan {tuple(mine_prefill.shape)} {tuple(mine_trailing.shape)}; "
                  f"max abs err {err:.2e}")
    print(f"{len(paths) - failures}/{len(paths)} snapshots match the official prefill")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
