//! The prompt plan against the official layout (qwen3-tts-spec.md §3.3, modeling_qwen3_tts.py
//! :1968-2241). Two kinds of checks:
//! - layout rules asserted directly (row counts, where tts_bos / codec_bos sit, text-only rows,
//!   trailing lengths, the worked example of §3.3 row by row, every bad-input error);
//! - JSON snapshots of every mode and text mode under `tests/snapshots/prompt_plan/`, reviewed
//!   against the spec and checked against the official code by
//!   `scripts/prompt/check_snapshots_official.py`. Regenerate with `UPDATE_PROMPT_SNAPSHOTS=1`.
//!
//! Text ids are real Qwen2 tokenizer output for the strings named beside them.

use std::path::PathBuf;

use serde_json::{Value, json};
use voxkernel_core::backend::Frame;
use voxkernel_core::config::ModelConfig;
use voxkernel_core::prompt::{
    CodecSource, PlanLimits, PrefillRow, PromptPlan, PromptRequest, TextIds, TextMode, Voice,
    build_plan, build_plan_with_limits, default_text_mode,
};

const IM_START: u32 = 151644;
const ASSISTANT: u32 = 77091;
const NEWLINE: u32 = 198;
const TTS_PAD: u32 = 151671;
const TTS_BOS: u32 = 151672;
const TTS_EOS: u32 = 151673;
const CODEC_PAD: u32 = 2148;
const CODEC_BOS: u32 = 2149;
const THINK: u32 = 2154;
const NOTHINK: u32 = 2155;
const THINK_BOS: u32 = 2156;
const THINK_EOS: u32 = 2157;
const ENGLISH: u32 = 2050;
const CHINESE: u32 = 2055;
const BEIJING_DIALECT: u32 = 2074;
const SICHUAN_DIALECT: u32 = 2062;
const RYAN: u32 = 3061;

/// "Hello there."
const HELLO: &[u32] = &[9707, 1052, 13];
/// "Good morning, how are you today?"
const MORNING: &[u32] = &[15216, 6556, 11, 1246, 525, 498, 3351, 30];
/// "你好，世界。"
const NIHAO: &[u32] = &[108386, 3837, 99489, 1773];
/// Reference transcript "This is my voice."
const REFERENCE: &[u32] = &[1986, 374, 847, 7743, 13];
/// Instruct "Speak slowly and warmly." as the whole `<|im_start|>user\n...<|im_end|>\n` string.
const INSTRUCT_STYLE: &[u32] = &[151644, 872, 198, 95845, 13970, 323, 96370, 13, 151645, 198];
/// Instruct "A deep male voice, calm."
const INSTRUCT_DESIGN: &[u32] = &[
    151644, 872, 198, 32, 5538, 8593, 7743, 11, 19300, 13, 151645, 198,
];
/// "\nHi!": the leading break merges with the role's "\n" into token 271.
const HI_ROLE: [u32; 3] = [151644, 77091, 271];
const HI: &[u32] = &[13048, 0];

// ---------------------------------------------------------------------------------------------
// Configs: the released 0.6B-Base config, and variants derived the way make_ckpt.py does.

#[derive(Debug, Clone, Copy, PartialEq)]
enum Variant {
    Base0b6,
    CustomVoice0b6,
    CustomVoice1b7,
    VoiceDesign1b7,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Base0b6 => "base-0b6",
            Variant::CustomVoice0b6 => "custom_voice-0b6",
            Variant::CustomVoice1b7 => "custom_voice-1b7",
            Variant::VoiceDesign1b7 => "voice_design-1b7",
        }
    }

    fn config(self) -> ModelConfig {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/configs/0.6b-base.config.json");
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let (model_type, is_1b7) = match self {
            Variant::Base0b6 => ("base", false),
            Variant::CustomVoice0b6 => ("custom_voice", false),
            Variant::CustomVoice1b7 => ("custom_voice", true),
            Variant::VoiceDesign1b7 => ("voice_design", true),
        };
        cfg["tts_model_type"] = json!(model_type);
        if model_type == "custom_voice" {
            let talker = &mut cfg["talker_config"];
            talker["spk_id"] = json!({"vivian": 3065, "serena": 3066, "uncle_fu": 3010,
                "dylan": 2878, "eric": 2875, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
                "sohee": 2864});
            talker["spk_is_dialect"] = json!({"vivian": false, "serena": false,
                "uncle_fu": false, "dylan": "beijing_dialect", "eric": "sichuan_dialect",
                "ryan": false, "aiden": false, "ono_anna": false, "sohee": false});
            talker["codec_language_id"]["beijing_dialect"] = json!(BEIJING_DIALECT);
            talker["codec_language_id"]["sichuan_dialect"] = json!(SICHUAN_DIALECT);
        }
        if is_1b7 {
            cfg["tts_model_size"] = json!("1b7");
            cfg["talker_config"]["hidden_size"] = json!(2048);
            cfg["talker_config"]["intermediate_size"] = json!(6144);
            cfg["speaker_encoder_config"]["enc_dim"] = json!(2048);
        }
        ModelConfig::from_json(&cfg.to_string()).unwrap()
    }
}

// ---------------------------------------------------------------------------------------------
// Cases shared by the snapshot test and the layout tests.

struct Case {
    name: &'static str,
    variant: Variant,
    request: PromptRequest,
    ids: TextIds,
}

fn ids(target: &[u32]) -> TextIds {
    TextIds {
        target: target.to_vec(),
        ..TextIds::default()
    }
}

fn with_instruct(target: &[u32], instruct: &[u32]) -> TextIds {
    TextIds {
        instruct: Some(instruct.to_vec()),
        ..ids(target)
    }
}

fn with_reference(target: &[u32]) -> TextIds {
    TextIds {
        reference: Some(REFERENCE.to_vec()),
        ..ids(target)
    }
}

fn request(voice: Voice, language: &str, text_mode: TextMode) -> PromptRequest {
    PromptRequest {
        voice,
        language: language.to_string(),
        text_mode,
    }
}

fn speaker(name: &str) -> Voice {
    Voice::Speaker(name.to_string())
}

/// A recognisable x-vector of the 0.6B talker width.
fn x_vector() -> Vec<f32> {
    (0..1024).map(|i| i as f32 / 1024.0).collect()
}

/// `n` distinct, in-range reference frames.
fn reference_frames(n: usize) -> Vec<Frame> {
    (0..n)
        .map(|k| std::array::from_fn(|g| ((k * 16 + g) * 37 % 2048) as u32))
        .collect()
}

fn clone_voice(frames: usize) -> Voice {
    Voice::Clone {
        x_vector: x_vector(),
        reference_codes: reference_frames(frames),
        // The planner reads the transcript's ids from TextIds::reference.
        reference_text: String::new(),
    }
}

fn cases() -> Vec<Case> {
    use TextMode::{Streaming, Whole};
    use Variant::*;
    let case = |name, variant, request, ids| Case {
        name,
        variant,
        request,
        ids,
    };
    vec![
        case(
            "custom_voice_ryan_english_whole",
            CustomVoice1b7,
            request(speaker("ryan"), "english", Whole),
            ids(HELLO),
        ),
        case(
            "custom_voice_ryan_english_streaming",
            CustomVoice1b7,
            request(speaker("ryan"), "english", Streaming),
            ids(HELLO),
        ),
        case(
            "custom_voice_vivian_auto_instruct_whole",
            CustomVoice1b7,
            request(speaker("Vivian"), "Auto", Whole),
            with_instruct(NIHAO, INSTRUCT_STYLE),
        ),
        case(
            "custom_voice_vivian_auto_instruct_streaming",
            CustomVoice1b7,
            request(speaker("vivian"), "auto", Streaming),
            with_instruct(NIHAO, INSTRUCT_STYLE),
        ),
        case(
            "custom_voice_dylan_chinese_dialect_whole",
            CustomVoice1b7,
            request(speaker("dylan"), "chinese", Whole),
            ids(NIHAO),
        ),
        case(
            "custom_voice_eric_auto_dialect_streaming",
            CustomVoice1b7,
            request(speaker("eric"), "auto", Streaming),
            ids(NIHAO),
        ),
        case(
            "custom_voice_0b6_instruct_dropped_whole",
            CustomVoice0b6,
            request(speaker("ryan"), "english", Whole),
            with_instruct(HELLO, INSTRUCT_STYLE),
        ),
        case(
            "custom_voice_leading_newline_role_whole",
            CustomVoice1b7,
            request(speaker("aiden"), "english", Whole),
            TextIds {
                target_role: Some(HI_ROLE),
                ..ids(HI)
            },
        ),
        case(
            "voice_design_english_whole",
            VoiceDesign1b7,
            request(Voice::Design, "english", Whole),
            with_instruct(MORNING, INSTRUCT_DESIGN),
        ),
        case(
            "voice_design_auto_streaming",
            VoiceDesign1b7,
            request(Voice::Design, "auto", Streaming),
            with_instruct(MORNING, INSTRUCT_DESIGN),
        ),
        case(
            "base_x_vector_english_streaming",
            Base0b6,
            request(Voice::XVector(x_vector()), "english", Streaming),
            ids(MORNING),
        ),
        case(
            "base_x_vector_auto_whole",
            Base0b6,
            request(Voice::XVector(x_vector()), "auto", Whole),
            ids(MORNING),
        ),
        // Text block R+N+1 = 14 > codec block 1+4 = 5: the rest of the text trails.
        case(
            "base_clone_text_longer_streaming",
            Base0b6,
            request(clone_voice(4), "english", Streaming),
            with_reference(MORNING),
        ),
        // Text block 5+3+1 = 9 < codec block 1+12 = 13: text padded with tts_pad.
        case(
            "base_clone_text_shorter_streaming",
            Base0b6,
            request(clone_voice(12), "english", Streaming),
            with_reference(HELLO),
        ),
        // Text block 9 == codec block 1+8.
        case(
            "base_clone_text_equal_streaming",
            Base0b6,
            request(clone_voice(8), "auto", Streaming),
            with_reference(HELLO),
        ),
        case(
            "base_clone_whole",
            Base0b6,
            request(clone_voice(4), "english", Whole),
            with_reference(MORNING),
        ),
    ]
}

fn plan_of(case: &Case) -> PromptPlan {
    build_plan(&case.variant.config(), &case.request, &case.ids)
        .unwrap_or_else(|e| panic!("{}: {e:#}", case.name))
}

fn find_case(name: &str) -> Case {
    cases().into_iter().find(|c| c.name == name).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Snapshots.

fn voice_json(voice: &Voice) -> Value {
    match voice {
        Voice::Speaker(name) => json!({"kind": "speaker", "name": name}),
        Voice::Design => json!({"kind": "design"}),
        Voice::XVector(v) => json!({"kind": "x_vector", "width": v.len()}),
        Voice::Clone {
            x_vector,
            reference_codes,
            ..
        } => json!({"kind": "clone", "width": x_vector.len(), "reference_codes": reference_codes}),
    }
}

fn snapshot_json(case: &Case, plan: &PromptPlan) -> Value {
    json!({
        "variant": case.variant.name(),
        "request": {
            "voice": voice_json(&case.request.voice),
            "language": case.request.language,
            "text_mode": case.request.text_mode,
            "target": case.ids.target,
            "target_role": case.ids.target_role,
            "instruct": case.ids.instruct,
            "reference": case.ids.reference,
        },
        "plan": plan,
        "plan_extras": {
            "speaker_vector_width": plan.speaker_vector.as_ref().map(Vec::len),
            "reference_frames": plan.reference_codes.len(),
        },
    })
}

/// Pretty JSON, but each prefill row and each reference frame on one line so a reviewer can
/// read the layout top to bottom.
fn render(value: &Value, indent: usize) -> String {
    let pad = "  ".repeat(indent + 1);
    let close = "  ".repeat(indent);
    match value {
        Value::Object(map) if indent < 2 => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{pad}{}: {}", json!(k), render(v, indent + 1)))
                .collect();
            format!("{{\n{}\n{close}}}", fields.join(",\n"))
        }
        Value::Array(items) if items.iter().any(|v| v.is_object() || v.is_array()) => {
            let lines: Vec<String> = items.iter().map(|v| format!("{pad}{v}")).collect();
            format!("[\n{}\n{close}]", lines.join(",\n"))
        }
        other => other.to_string(),
    }
}

#[test]
fn snapshots_of_every_mode_match() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/prompt_plan");
    let update = std::env::var_os("UPDATE_PROMPT_SNAPSHOTS").is_some();
    let mut mismatches = Vec::new();
    for case in cases() {
        let text = render(&snapshot_json(&case, &plan_of(&case)), 0) + "\n";
        let path = dir.join(format!("{}.json", case.name));
        if update {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let stored = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run with UPDATE_PROMPT_SNAPSHOTS=1",
                path.display()
            )
        });
        let stored: Value = serde_json::from_str(&stored).unwrap();
        let fresh: Value = serde_json::from_str(&text).unwrap();
        if stored != fresh {
            eprintln!("{} differs; now:\n{text}", case.name);
            mismatches.push(case.name);
        }
    }
    assert!(mismatches.is_empty(), "snapshots differ: {mismatches:?}");
}

// ---------------------------------------------------------------------------------------------
// Layout rules.

fn text_row(text_id: u32) -> PrefillRow {
    PrefillRow {
        text_id,
        codec: CodecSource::None,
    }
}

fn row(text_id: u32, codec_id: u32) -> PrefillRow {
    PrefillRow {
        text_id,
        codec: CodecSource::Id(codec_id),
    }
}

fn role_rows() -> Vec<PrefillRow> {
    vec![text_row(IM_START), text_row(ASSISTANT), text_row(NEWLINE)]
}

/// Index of the single row whose codec track is codec_bos.
fn codec_bos_index(plan: &PromptPlan) -> usize {
    let hits: Vec<usize> = (0..plan.prefill.len())
        .filter(|&i| plan.prefill[i].codec == CodecSource::Id(CODEC_BOS))
        .collect();
    assert_eq!(hits.len(), 1, "exactly one codec_bos row: {hits:?}");
    hits[0]
}

/// Index of the single tts_bos row.
fn tts_bos_index(plan: &PromptPlan) -> usize {
    let hits: Vec<usize> = (0..plan.prefill.len())
        .filter(|&i| plan.prefill[i].text_id == TTS_BOS)
        .collect();
    assert_eq!(hits.len(), 1, "exactly one tts_bos row: {hits:?}");
    hits[0]
}

#[test]
fn worked_example_ryan_english_row_by_row() {
    let plan = plan_of(&find_case("custom_voice_ryan_english_whole"));
    let mut expected = role_rows();
    expected.extend([
        row(TTS_PAD, THINK),
        row(TTS_PAD, THINK_BOS),
        row(TTS_PAD, ENGLISH),
        row(TTS_PAD, THINK_EOS),
        row(TTS_PAD, RYAN),
        row(TTS_BOS, CODEC_PAD),
    ]);
    expected.extend(HELLO.iter().map(|&t| row(t, CODEC_PAD)));
    expected.extend([row(TTS_EOS, CODEC_PAD), row(TTS_PAD, CODEC_BOS)]);
    assert_eq!(plan.prefill, expected);
    assert_eq!(plan.prefill.len(), 11 + HELLO.len());
    assert!(plan.trailing.is_empty());
    assert_eq!(plan.tts_pad_id, TTS_PAD);
    assert_eq!(plan.speaker_vector, None);
    assert!(plan.reference_codes.is_empty());
}

#[test]
fn streaming_puts_first_token_on_codec_bos_and_trails_the_rest() {
    let plan = plan_of(&find_case("custom_voice_ryan_english_streaming"));
    let whole = plan_of(&find_case("custom_voice_ryan_english_whole"));
    // Same head (role + 5 control rows + tts_bos row) as whole mode.
    assert_eq!(plan.prefill[..9], whole.prefill[..9]);
    assert_eq!(plan.prefill[9..], [row(HELLO[0], CODEC_BOS)]);
    assert_eq!(codec_bos_index(&plan), plan.prefill.len() - 1);
    // N-1 remaining tokens, then tts_eos.
    assert_eq!(plan.trailing.len(), HELLO.len() - 1 + 1);
    assert_eq!(plan.trailing[..HELLO.len() - 1], HELLO[1..]);
    assert_eq!(plan.trailing.last(), Some(&TTS_EOS));
}

#[test]
fn instruct_rows_come_first_and_are_text_only() {
    for name in [
        "custom_voice_vivian_auto_instruct_whole",
        "custom_voice_vivian_auto_instruct_streaming",
        "voice_design_english_whole",
        "voice_design_auto_streaming",
    ] {
        let case = find_case(name);
        let plan = plan_of(&case);
        let instruct = case.ids.instruct.clone().unwrap();
        let mut expected: Vec<PrefillRow> = instruct.iter().map(|&t| text_row(t)).collect();
        expected.extend(role_rows());
        let text_only: Vec<PrefillRow> = plan
            .prefill
            .iter()
            .copied()
            .filter(PrefillRow::is_text_only)
            .collect();
        assert_eq!(text_only, expected, "{name}");
        assert_eq!(plan.prefill[..expected.len()], expected, "{name}");
    }
}

#[test]
fn custom_voice_whole_row_count_is_11_plus_n_plus_instruct() {
    let plain = plan_of(&find_case("custom_voice_ryan_english_whole"));
    assert_eq!(plain.prefill.len(), 11 + HELLO.len());
    // "auto" drops the language row (nothink block of 3) and the instruct adds its rows.
    let instructed = plan_of(&find_case("custom_voice_vivian_auto_instruct_whole"));
    assert_eq!(
        instructed.prefill.len(),
        10 + NIHAO.len() + INSTRUCT_STYLE.len()
    );
}

#[test]
fn tts_bos_carries_codec_pad_and_follows_the_control_rows_in_every_mode() {
    for case in cases() {
        let plan = plan_of(&case);
        let bos = tts_bos_index(&plan);
        assert_eq!(
            plan.prefill[bos].codec,
            CodecSource::Id(CODEC_PAD),
            "{}",
            case.name
        );
        let instruct = case.ids.instruct.as_ref().map_or(0, Vec::len);
        let instruct = if case.variant == Variant::CustomVoice0b6 {
            0
        } else {
            instruct
        };
        // Control rows between the role prefix and tts_bos all carry tts_pad.
        let control = &plan.prefill[instruct + 3..bos];
        assert!(
            (3..=5).contains(&control.len()),
            "{}: {control:?}",
            case.name
        );
        assert!(
            control
                .iter()
                .all(|r| r.text_id == TTS_PAD && !r.is_text_only())
        );
        assert_eq!(plan.tts_pad_id, TTS_PAD);
    }
}

#[test]
fn codec_bos_is_last_in_whole_mode_and_on_the_first_text_token_in_streaming() {
    for case in cases() {
        if matches!(case.request.voice, Voice::Clone { .. }) {
            continue;
        }
        let plan = plan_of(&case);
        let at = codec_bos_index(&plan);
        assert_eq!(at, plan.prefill.len() - 1, "{}", case.name);
        let n = case.ids.target.len();
        match case.request.text_mode {
            TextMode::Whole => {
                assert_eq!(plan.prefill[at].text_id, TTS_PAD, "{}", case.name);
                assert!(plan.trailing.is_empty(), "{}", case.name);
                let body = &plan.prefill[at - n - 1..at];
                let texts: Vec<u32> = body.iter().map(|r| r.text_id).collect();
                assert_eq!(texts[..n], case.ids.target[..], "{}", case.name);
                assert_eq!(texts[n], TTS_EOS, "{}", case.name);
                assert!(body.iter().all(|r| r.codec == CodecSource::Id(CODEC_PAD)));
            }
            TextMode::Streaming => {
                assert_eq!(
                    plan.prefill[at].text_id, case.ids.target[0],
                    "{}",
                    case.name
                );
                assert_eq!(plan.trailing.len(), n, "{}", case.name);
                assert_eq!(plan.prefill[at - 1].text_id, TTS_BOS, "{}", case.name);
            }
        }
    }
}

/// The rows from the end of the role prefix through the tts_bos row.
fn control_rows(plan: &PromptPlan, instruct_len: usize) -> Vec<PrefillRow> {
    plan.prefill[instruct_len + 3..=tts_bos_index(plan)].to_vec()
}

fn think_block(language: u32, speaker: u32) -> Vec<PrefillRow> {
    vec![
        row(TTS_PAD, THINK),
        row(TTS_PAD, THINK_BOS),
        row(TTS_PAD, language),
        row(TTS_PAD, THINK_EOS),
        row(TTS_PAD, speaker),
        row(TTS_BOS, CODEC_PAD),
    ]
}

#[test]
fn language_blocks_and_dialect_overrides() {
    // dylan + chinese -> the Beijing dialect id replaces chinese.
    let dylan = plan_of(&find_case("custom_voice_dylan_chinese_dialect_whole"));
    assert_eq!(control_rows(&dylan, 0), think_block(BEIJING_DIALECT, 2878));
    // eric + auto -> the think path (not nothink) with the Sichuan dialect id.
    let eric = plan_of(&find_case("custom_voice_eric_auto_dialect_streaming"));
    assert_eq!(control_rows(&eric, 0), think_block(SICHUAN_DIALECT, 2875));

    let config = Variant::CustomVoice1b7.config();
    let plan_for = |name: &str, language: &str| {
        build_plan(
            &config,
            &request(speaker(name), language, TextMode::Whole),
            &ids(NIHAO),
        )
        .unwrap()
    };
    // A dialect speaker in another language keeps that language.
    assert_eq!(
        control_rows(&plan_for("Dylan", "English"), 0),
        think_block(ENGLISH, 2878)
    );
    // A plain speaker keeps chinese; "auto" gives the nothink block without a language row.
    assert_eq!(
        control_rows(&plan_for("vivian", "Chinese"), 0),
        think_block(CHINESE, 3065)
    );
    let auto = plan_of(&find_case("custom_voice_vivian_auto_instruct_whole"));
    assert_eq!(
        control_rows(&auto, INSTRUCT_STYLE.len()),
        [
            row(TTS_PAD, NOTHINK),
            row(TTS_PAD, THINK_BOS),
            row(TTS_PAD, THINK_EOS),
            row(TTS_PAD, 3065),
            row(TTS_BOS, CODEC_PAD)
        ]
    );
}

#[test]
fn small_custom_voice_drops_the_instruct() {
    let config = Variant::CustomVoice0b6.config();
    let case = find_case("custom_voice_0b6_instruct_dropped_whole");
    let dropped = plan_of(&case);
    let without = build_plan(&config, &case.request, &ids(HELLO)).unwrap();
    assert_eq!(dropped, without);
    assert!(dropped.prefill[..3] == role_rows()[..]);
}

#[test]
fn voice_design_has_no_speaker_row() {
    let plan = plan_of(&find_case("voice_design_english_whole"));
    let head = INSTRUCT_DESIGN.len() + 3;
    assert_eq!(
        plan.prefill[head..head + 5],
        [
            row(TTS_PAD, THINK),
            row(TTS_PAD, THINK_BOS),
            row(TTS_PAD, ENGLISH),
            row(TTS_PAD, THINK_EOS),
            row(TTS_BOS, CODEC_PAD)
        ]
    );
    assert_eq!(
        plan.prefill.len(),
        INSTRUCT_DESIGN.len() + 10 + MORNING.len()
    );
}

#[test]
fn x_vector_fills_the_speaker_slot() {
    let plan = plan_of(&find_case("base_x_vector_english_streaming"));
    assert_eq!(
        plan.prefill[7],
        PrefillRow {
            text_id: TTS_PAD,
            codec: CodecSource::SpeakerVector
        }
    );
    assert_eq!(plan.prefill[8], row(TTS_BOS, CODEC_PAD));
    assert_eq!(plan.prefill[9], row(MORNING[0], CODEC_BOS));
    assert_eq!(plan.prefill.len(), 10);
    assert_eq!(plan.speaker_vector, Some(x_vector()));
    assert!(plan.reference_codes.is_empty());
    let whole = plan_of(&find_case("base_x_vector_auto_whole"));
    assert_eq!(
        whole.prefill[6],
        PrefillRow {
            text_id: TTS_PAD,
            codec: CodecSource::SpeakerVector
        }
    );
    assert_eq!(whole.prefill.len(), 10 + MORNING.len());
}

/// The ICL text block R ++ T ++ [tts_eos].
fn text_block(target: &[u32]) -> Vec<u32> {
    REFERENCE
        .iter()
        .chain(target)
        .chain([&TTS_EOS])
        .copied()
        .collect()
}

#[test]
fn icl_head_is_role_then_control_rows_with_the_x_vector() {
    let speaker_row = PrefillRow {
        text_id: TTS_PAD,
        codec: CodecSource::SpeakerVector,
    };
    let plan = plan_of(&find_case("base_clone_text_longer_streaming"));
    let mut expected = role_rows();
    expected.extend(think_block(ENGLISH, 0));
    expected[7] = speaker_row;
    assert_eq!(plan.prefill[..=tts_bos_index(&plan)], expected);
    let auto = plan_of(&find_case("base_clone_text_equal_streaming"));
    assert_eq!(
        control_rows(&auto, 0),
        [
            row(TTS_PAD, NOTHINK),
            row(TTS_PAD, THINK_BOS),
            row(TTS_PAD, THINK_EOS),
            speaker_row,
            row(TTS_BOS, CODEC_PAD)
        ]
    );
}

#[test]
fn icl_streaming_text_longer_than_codec_block_trails() {
    let plan = plan_of(&find_case("base_clone_text_longer_streaming"));
    let head = tts_bos_index(&plan) + 1;
    let text = text_block(MORNING);
    assert_eq!(text.len(), 14);
    assert_eq!(
        codec_bos_index(&plan),
        head,
        "codec_bos opens the codec block"
    );
    let body = &plan.prefill[head..];
    assert_eq!(body.len(), 1 + 4);
    assert_eq!(body[0], row(text[0], CODEC_BOS));
    for k in 0..4 {
        assert_eq!(
            body[k + 1],
            PrefillRow {
                text_id: text[k + 1],
                codec: CodecSource::ReferenceFrame(k)
            }
        );
    }
    assert_eq!(plan.trailing, text[5..]);
    assert_eq!(plan.trailing.last(), Some(&TTS_EOS));
    assert_eq!(plan.reference_codes, reference_frames(4));
    assert_eq!(plan.speaker_vector, Some(x_vector()));
}

#[test]
fn icl_streaming_text_shorter_than_codec_block_pads_with_tts_pad() {
    for (name, frames) in [
        ("base_clone_text_shorter_streaming", 12),
        ("base_clone_text_equal_streaming", 8),
    ] {
        let plan = plan_of(&find_case(name));
        let text = text_block(HELLO);
        let head = tts_bos_index(&plan) + 1;
        let body = &plan.prefill[head..];
        assert_eq!(body.len(), frames + 1, "{name}");
        assert_eq!(codec_bos_index(&plan), head, "{name}");
        for (i, r) in body.iter().enumerate() {
            let text_id = text.get(i).copied().unwrap_or(TTS_PAD);
            let codec = if i == 0 {
                CodecSource::Id(CODEC_BOS)
            } else {
                CodecSource::ReferenceFrame(i - 1)
            };
            assert_eq!(*r, PrefillRow { text_id, codec }, "{name} row {i}");
        }
        assert!(plan.trailing.is_empty(), "{name}");
    }
}

#[test]
fn icl_whole_puts_text_on_codec_pad_then_frames_on_tts_pad() {
    let plan = plan_of(&find_case("base_clone_whole"));
    let head = tts_bos_index(&plan) + 1;
    let text = text_block(MORNING);
    let body = &plan.prefill[head..];
    assert_eq!(body.len(), text.len() + 1 + 4);
    for (i, &t) in text.iter().enumerate() {
        assert_eq!(body[i], row(t, CODEC_PAD));
    }
    assert_eq!(codec_bos_index(&plan), head + text.len());
    assert_eq!(body[text.len()], row(TTS_PAD, CODEC_BOS));
    for k in 0..4 {
        assert_eq!(
            body[text.len() + 1 + k],
            PrefillRow {
                text_id: TTS_PAD,
                codec: CodecSource::ReferenceFrame(k)
            }
        );
    }
    assert!(plan.trailing.is_empty());
}

#[test]
fn leading_newline_role_is_kept() {
    let plan = plan_of(&find_case("custom_voice_leading_newline_role_whole"));
    assert_eq!(
        plan.prefill[..3],
        [
            text_row(HI_ROLE[0]),
            text_row(HI_ROLE[1]),
            text_row(HI_ROLE[2])
        ]
    );
    assert_eq!(plan.prefill.len(), 11 + HI.len());
}

#[test]
fn default_text_modes_follow_the_official_entry_points() {
    assert_eq!(default_text_mode(&speaker("ryan")), TextMode::Whole);
    assert_eq!(default_text_mode(&Voice::Design), TextMode::Whole);
    assert_eq!(
        default_text_mode(&Voice::XVector(x_vector())),
        TextMode::Streaming
    );
    assert_eq!(default_text_mode(&clone_voice(2)), TextMode::Streaming);
}

// ---------------------------------------------------------------------------------------------
// Bad input.

fn error_of(variant: Variant, request: PromptRequest, ids: TextIds) -> String {
    let err = build_plan(&variant.config(), &request, &ids).expect_err("must be rejected");
    format!("{err:#}")
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
}

#[test]
fn unknown_speaker_lists_the_speakers() {
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("bob"), "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(
        &msg,
        &[
            "voice.speaker",
            "\"bob\"",
            "aiden",
            "dylan",
            "vivian",
            "uncle_fu",
        ],
    );
}

#[test]
fn unknown_language_lists_the_languages() {
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("ryan"), "klingon", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(
        &msg,
        &[
            "language", "klingon", "auto", "english", "chinese", "russian",
        ],
    );
    assert!(
        !msg.contains("dialect"),
        "dialects are not requestable: {msg}"
    );
    // Dialect keys are selected only through dialect speakers.
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("ryan"), "beijing_dialect", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(&msg, &["language", "beijing_dialect"]);
}

#[test]
fn voice_must_fit_the_model_type() {
    let msg = error_of(
        Variant::VoiceDesign1b7,
        request(speaker("ryan"), "english", TextMode::Whole),
        with_instruct(HELLO, INSTRUCT_DESIGN),
    );
    assert_mentions(
        &msg,
        &["voice", "speaker", "voice_design", "valid voices: design"],
    );
    let msg = error_of(
        Variant::Base0b6,
        request(speaker("ryan"), "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(&msg, &["voice", "base", "x_vector, clone"]);
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(Voice::Design, "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(
        &msg,
        &["voice", "needs a speaker", "ryan", "valid voices: speaker"],
    );
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(Voice::XVector(x_vector()), "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(&msg, &["x_vector", "custom_voice"]);
    let msg = error_of(
        Variant::Base0b6,
        request(Voice::Design, "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(&msg, &["design", "base", "x_vector, clone"]);
}

#[test]
fn instruct_rules() {
    let msg = error_of(
        Variant::VoiceDesign1b7,
        request(Voice::Design, "english", TextMode::Whole),
        ids(HELLO),
    );
    assert_mentions(&msg, &["text.instruct", "voice_design"]);
    let msg = error_of(
        Variant::Base0b6,
        request(Voice::XVector(x_vector()), "english", TextMode::Whole),
        with_instruct(HELLO, INSTRUCT_STYLE),
    );
    assert_mentions(&msg, &["text.instruct", "base"]);
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("ryan"), "english", TextMode::Whole),
        with_instruct(HELLO, &[]),
    );
    assert_mentions(&msg, &["text.instruct", "None"]);
}

#[test]
fn x_vector_of_the_wrong_width_is_rejected() {
    let msg = error_of(
        Variant::Base0b6,
        request(
            Voice::XVector(vec![0.0; 2048]),
            "english",
            TextMode::Streaming,
        ),
        ids(HELLO),
    );
    assert_mentions(&msg, &["voice.x_vector", "2048", "1024"]);
    let voice = Voice::Clone {
        x_vector: vec![0.0; 7],
        reference_codes: reference_frames(2),
        reference_text: String::new(),
    };
    let msg = error_of(
        Variant::Base0b6,
        request(voice, "english", TextMode::Streaming),
        with_reference(HELLO),
    );
    assert_mentions(&msg, &["voice.x_vector", "7", "1024"]);
}

#[test]
fn target_text_must_be_non_empty_and_within_the_limit() {
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("ryan"), "english", TextMode::Whole),
        ids(&[]),
    );
    assert_mentions(&msg, &["text.target", "empty"]);
    let config = Variant::CustomVoice1b7.config();
    let req = request(speaker("ryan"), "english", TextMode::Streaming);
    let limits = PlanLimits { max_text_tokens: 8 };
    assert!(build_plan_with_limits(&config, &req, &ids(MORNING), limits).is_ok());
    let nine: Vec<u32> = MORNING.iter().chain([&13]).copied().collect();
    let err = build_plan_with_limits(&config, &req, &ids(&nine), limits).unwrap_err();
    assert_mentions(
        &format!("{err:#}"),
        &["text.target", "9 tokens", "limit of 8"],
    );
    assert_eq!(PlanLimits::default().max_text_tokens, 4096);
    let msg = error_of(Variant::CustomVoice1b7, req, ids(&[151936]));
    assert_mentions(&msg, &["text.target", "151936", "0..151936"]);
}

#[test]
fn icl_needs_reference_text_and_codes() {
    let msg = error_of(
        Variant::Base0b6,
        request(clone_voice(4), "english", TextMode::Streaming),
        ids(HELLO),
    );
    assert_mentions(&msg, &["text.reference", "transcript"]);
    let msg = error_of(
        Variant::Base0b6,
        request(clone_voice(0), "english", TextMode::Streaming),
        with_reference(HELLO),
    );
    assert_mentions(&msg, &["voice.reference_codes", "at least one"]);
    let empty_reference = TextIds {
        reference: Some(Vec::new()),
        ..ids(HELLO)
    };
    let msg = error_of(
        Variant::Base0b6,
        request(clone_voice(4), "english", TextMode::Streaming),
        empty_reference,
    );
    assert_mentions(&msg, &["text.reference", "empty"]);
    let mut frames = reference_frames(3);
    frames[2][5] = 2048;
    let voice = Voice::Clone {
        x_vector: x_vector(),
        reference_codes: frames,
        reference_text: String::new(),
    };
    let msg = error_of(
        Variant::Base0b6,
        request(voice, "english", TextMode::Streaming),
        with_reference(HELLO),
    );
    assert_mentions(&msg, &["voice.reference_codes[2][5]", "2048", "0..2048"]);
    let msg = error_of(
        Variant::Base0b6,
        request(Voice::XVector(x_vector()), "english", TextMode::Streaming),
        with_reference(HELLO),
    );
    assert_mentions(&msg, &["text.reference", "x_vector"]);
}

#[test]
fn role_prefix_must_be_the_assistant_role() {
    let bad = TextIds {
        target_role: Some([IM_START, 872, NEWLINE]),
        ..ids(HELLO)
    };
    let msg = error_of(
        Variant::CustomVoice1b7,
        request(speaker("ryan"), "english", TextMode::Whole),
        bad,
    );
    assert_mentions(&msg, &["text.target_role", "151644, 77091"]);
}
