//! Checkpoint validation against the released 0.6B-Base inventory and against inventories
//! dumped from the official qwen-tts classes (tests/fixtures/checkpoint/generate.py).

mod checkpoint_support;

use std::collections::BTreeMap;
use std::path::Path;

use checkpoint_support::*;
use safetensors::Dtype;
use voxkernel_core::checkpoint::{
    Checkpoint, ModelSummary, REQUIRED_FILES, SafetensorsFile, WeightFile, expected_tensors,
};
use voxkernel_core::config::{ModelConfig, ModelType, SpeechTokenizerConfig};

const VARIANTS: [&str; 4] = [
    "tiny-base",
    "tiny-custom_voice",
    "1.7b-base",
    "1.7b-voice_design",
];

/// config.json text, speech tokenizer config text, and the inventory of the released
/// 0.6B-Base checkpoint.
fn released_0_6b_base() -> (String, String, Inventory) {
    let dir = reference_checkpoints();
    (
        std::fs::read_to_string(dir.join("qwen3-tts-12hz-0.6b-base.config.json")).unwrap(),
        std::fs::read_to_string(dir.join("qwen3-tts-tokenizer-12hz.config.json")).unwrap(),
        read_inventory(&dir.join("qwen3-tts-12hz-0.6b-base.tensors.json")),
    )
}

fn fixture(variant: &str) -> (String, String, Inventory) {
    let dir = fixtures().join(variant);
    (
        std::fs::read_to_string(dir.join("config.json")).unwrap(),
        std::fs::read_to_string(dir.join("speech_tokenizer_config.json")).unwrap(),
        read_inventory(&dir.join("tensors.json")),
    )
}

fn derived_inventory(config: &str, speech_config: &str) -> Inventory {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, speech_config).unwrap();
    let codec = SpeechTokenizerConfig::from_file(&path).unwrap();
    let model = ModelConfig::from_json(config).unwrap();
    inventory_of(&expected_tensors(&model, &codec).unwrap())
}

/// Names only in `left` or only in `right`, and names whose entries differ, for a readable
/// failure message.
fn differences(left: &Inventory, right: &Inventory) -> Vec<String> {
    let mut out = Vec::new();
    for file in WeightFile::ALL {
        let empty = BTreeMap::new();
        let (l, r) = (
            left.get(&file).unwrap_or(&empty),
            right.get(&file).unwrap_or(&empty),
        );
        for (name, t) in l {
            match r.get(name) {
                None => out.push(format!("{file}: {name} only derived")),
                Some(u) if u != t => out.push(format!("{file}: {name} derived {t:?}, real {u:?}")),
                Some(_) => {}
            }
        }
        out.extend(
            r.keys()
                .filter(|name| !l.contains_key(*name))
                .map(|name| format!("{file}: {name} missing from derived list")),
        );
    }
    out
}

#[test]
fn derived_tensor_list_equals_the_released_0_6b_base_inventory() {
    let (config, speech, real) = released_0_6b_base();
    let derived = derived_inventory(&config, &speech);
    assert_eq!(real[&WeightFile::Model].len(), 478);
    assert_eq!(real[&WeightFile::SpeechTokenizer].len(), 496);
    let diff = differences(&derived, &real);
    assert!(diff.is_empty(), "{}", diff.join("\n"));
}

#[test]
fn derived_tensor_list_equals_the_official_classes_for_other_configs() {
    for variant in VARIANTS {
        let (config, speech, official) = fixture(variant);
        let diff = differences(&derived_inventory(&config, &speech), &official);
        assert!(diff.is_empty(), "{variant}:\n{}", diff.join("\n"));
    }
}

#[test]
fn projection_and_speaker_encoder_follow_the_config() {
    let has = |inv: &Inventory, prefix: &str| {
        inv[&WeightFile::Model]
            .keys()
            .any(|name| name.starts_with(prefix))
    };
    let (config, speech, _) = released_0_6b_base();
    let small = derived_inventory(&config, &speech);
    assert!(!has(
        &small,
        "talker.code_predictor.small_to_mtp_projection"
    ));
    assert!(has(&small, "speaker_encoder."));

    let (config, speech, _) = fixture("1.7b-voice_design");
    let large = derived_inventory(&config, &speech);
    assert_eq!(
        large[&WeightFile::Model]["talker.code_predictor.small_to_mtp_projection.weight"].shape,
        [1024, 2048]
    );
    assert!(!has(&large, "speaker_encoder."));
}

/// A header-only copy of the released 0.6B-Base checkpoint in a temp dir.
fn synthetic_0_6b_base() -> (tempfile::TempDir, Inventory) {
    let (config, speech, inventory) = released_0_6b_base();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &speech, &inventory);
    (dir, inventory)
}

fn open_err(dir: &Path) -> String {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened but should not have", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn synthetic_0_6b_base_validates_and_summarises() {
    let (dir, _) = synthetic_0_6b_base();
    let model_len = std::fs::metadata(dir.path().join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        model_len > 1_800_000_000,
        "sparse model file is {model_len} bytes"
    );

    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let summary = ModelSummary::new(&checkpoint);
    assert_eq!(summary.variant, ModelType::Base);
    assert_eq!(summary.size, "0b6");
    assert_eq!(summary.talker.hidden_size, 1024);
    assert_eq!(summary.talker.num_layers, 28);
    assert_eq!(summary.code_predictor.num_layers, 5);
    assert_eq!(summary.num_code_groups, 16);
    assert!(summary.speakers.is_empty());
    assert_eq!(summary.languages.len(), 11);
    assert_eq!(summary.languages[0], "auto");
    assert_eq!(summary.files["model.safetensors"].tensors, 478);
    assert_eq!(
        summary.files["speech_tokenizer/model.safetensors"].tensors,
        496
    );
    assert_eq!(summary.files["model.safetensors"].dtypes["BF16"], 478);
    // Sizes published for the release (spec §2.3): 914.6 M model parameters (1.83 GB BF16),
    // 170.55 M speech tokenizer parameters (682 MB F32).
    let model_params = summary.files["model.safetensors"].parameters;
    assert!(
        (914_500_000..914_700_000).contains(&model_params),
        "{model_params}"
    );
    let codec_params = summary.files["speech_tokenizer/model.safetensors"].parameters;
    assert!(
        (170_500_000..170_600_000).contains(&codec_params),
        "{codec_params}"
    );
    let parts = summary.talker.parameters
        + summary.code_predictor.parameters
        + summary.speaker_encoder_parameters.unwrap();
    assert_eq!(parts, model_params);
    assert_eq!(
        summary.codec_decoder.parameters + summary.codec_encoder_parameters,
        codec_params
    );
    assert_eq!(summary.codec_decoder.samples_per_frame, 1920);
    let json = serde_json::to_value(&summary).unwrap();
    assert_eq!(json["variant"], "base");
}

#[test]
fn synthetic_custom_voice_lists_its_speakers() {
    let (config, speech, inventory) = fixture("tiny-custom_voice");
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &speech, &inventory);
    let summary = ModelSummary::new(&Checkpoint::open(dir.path()).unwrap());
    assert_eq!(summary.variant, ModelType::CustomVoice);
    assert_eq!(summary.speaker_encoder_parameters, None);
    assert_eq!(summary.speakers.len(), 9);
    let dylan = summary.speakers.iter().find(|s| s.name == "dylan").unwrap();
    assert_eq!(dylan.codec_id, 2878);
    assert_eq!(dylan.dialect.as_deref(), Some("beijing_dialect"));
    assert!(!summary.languages.iter().any(|l| l.contains("dialect")));
}

/// Rewrites one weight file of `dir` with `edit` applied to its tensors, expects the open to
/// fail naming `name` and `file` with exactly one problem, then restores the file.
fn expect_single_problem(
    dir: &Path,
    inventory: &Inventory,
    file: WeightFile,
    name: &str,
    edit: impl FnOnce(&mut BTreeMap<String, HeaderTensor>),
) {
    let mut tensors = inventory[&file].clone();
    edit(&mut tensors);
    let path = dir.join(file.relative_path());
    write_sparse_safetensors(&path, &tensors);
    let err = open_err(dir);
    let named = err.contains(&format!("{file}: missing {name} "))
        || err.contains(&format!("{file}: {name} is "));
    assert!(named && err.contains(" 1 tensor(s)"), "{name}: {err}");
    write_sparse_safetensors(&path, &inventory[&file]);
}

#[test]
fn removing_any_single_tensor_fails_naming_it() {
    let (dir, inventory) = synthetic_0_6b_base();
    for file in WeightFile::ALL {
        for name in inventory[&file].keys() {
            expect_single_problem(dir.path(), &inventory, file, name, |t| {
                t.remove(name);
            });
        }
    }
    Checkpoint::open(dir.path()).unwrap();
}

#[test]
fn reshaping_any_single_tensor_fails_naming_it() {
    let (dir, inventory) = synthetic_0_6b_base();
    for file in WeightFile::ALL {
        for (index, name) in inventory[&file].keys().enumerate() {
            expect_single_problem(dir.path(), &inventory, file, name, |t| {
                let shape = &mut t.get_mut(name).unwrap().shape;
                // Alternate between a wrong size and a wrong rank.
                if index % 2 == 0 {
                    *shape.last_mut().unwrap() += 1;
                } else {
                    shape.push(1);
                }
            });
        }
    }
}

#[test]
fn dtypes_other_than_bf16_or_f32_are_flagged() {
    let (dir, inventory) = synthetic_0_6b_base();
    let name = "talker.model.norm.weight";
    expect_single_problem(dir.path(), &inventory, WeightFile::Model, name, |t| {
        t.get_mut(name).unwrap().dtype = Dtype::F16;
    });
    let name = "decoder.pre_transformer.norm.weight";
    expect_single_problem(
        dir.path(),
        &inventory,
        WeightFile::SpeechTokenizer,
        name,
        |t| {
            t.get_mut(name).unwrap().dtype = Dtype::I64;
        },
    );

    // The other float width is fine in both files.
    let swap = |file: WeightFile, dtype: Dtype| {
        let mut tensors = inventory[&file].clone();
        tensors.values_mut().for_each(|t| t.dtype = dtype);
        write_sparse_safetensors(&dir.path().join(file.relative_path()), &tensors);
    };
    swap(WeightFile::Model, Dtype::F32);
    swap(WeightFile::SpeechTokenizer, Dtype::BF16);
    Checkpoint::open(dir.path()).unwrap();
}

#[test]
fn one_error_lists_every_problem_and_extra_tensors_are_ignored() {
    let (dir, inventory) = synthetic_0_6b_base();
    let mut model = inventory[&WeightFile::Model].clone();
    let removed = [
        "talker.model.layers.27.mlp.up_proj.weight",
        "speaker_encoder.fc.bias",
        "talker.code_predictor.lm_head.14.weight",
    ];
    for name in removed {
        model.remove(name).unwrap();
    }
    model.insert(
        "talker.model.unexpected_extra.weight".into(),
        HeaderTensor {
            dtype: Dtype::BF16,
            shape: vec![4],
        },
    );
    let mut speech = inventory[&WeightFile::SpeechTokenizer].clone();
    let reshaped = [
        "decoder.upsample.1.1.gamma",
        "encoder.quantizer.acoustic_residual_vector_quantizer.layers.30.codebook.embed_sum",
    ];
    for name in reshaped {
        speech.get_mut(name).unwrap().shape[0] = 7;
    }
    write_sparse_safetensors(&dir.path().join("model.safetensors"), &model);
    write_sparse_safetensors(
        &dir.path().join("speech_tokenizer/model.safetensors"),
        &speech,
    );
    let err = open_err(dir.path());
    assert!(err.contains(" 5 tensor(s)"), "{err}");
    for name in removed {
        assert!(
            err.contains(&format!("model.safetensors: missing {name} ")),
            "{err}"
        );
    }
    for name in reshaped {
        assert!(
            err.contains(&format!(
                "speech_tokenizer/model.safetensors: {name} is F32 [7"
            )),
            "{err}"
        );
    }
    assert!(!err.contains("unexpected_extra"), "{err}");
}

#[test]
fn missing_files_are_named() {
    let (dir, _) = synthetic_0_6b_base();
    for file in REQUIRED_FILES {
        let path = dir.path().join(file);
        let saved = dir.path().join("saved");
        std::fs::rename(&path, &saved).unwrap();
        let err = open_err(dir.path());
        assert!(err.contains(&format!("missing {file}")), "{file}: {err}");
        std::fs::rename(&saved, &path).unwrap();
    }
    Checkpoint::open(dir.path()).unwrap();
}

#[test]
fn corrupt_headers_are_errors_not_panics() {
    let (dir, inventory) = synthetic_0_6b_base();
    let path = dir.path().join("model.safetensors");
    let (header, data_len) = safetensors_header(&inventory[&WeightFile::Model]);
    let json_len = header.len() - 8;
    let mut cases: Vec<(&str, Vec<u8>, u64)> = vec![
        ("empty file", vec![], 0),
        ("short length prefix", vec![1, 2, 3], 3),
        ("length past the end", u64::MAX.to_le_bytes().to_vec(), 8),
    ];
    let mut garbage = header.clone();
    garbage[8..20].copy_from_slice(b"not json at ");
    cases.push(("invalid json", garbage, header.len() as u64 + data_len));
    let mut cut = (json_len as u64 / 2).to_le_bytes().to_vec();
    cut.extend_from_slice(&header[8..8 + json_len / 2]);
    cases.push(("truncated json", cut, 8 + json_len as u64 / 2));
    cases.push((
        "data section too short",
        header.clone(),
        header.len() as u64 + data_len - 1,
    ));
    for (what, bytes, len) in cases {
        std::fs::write(&path, &bytes).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        let err = open_err(dir.path());
        assert!(
            err.contains("model.safetensors") && err.contains("corrupt"),
            "{what}: {err}"
        );
    }
}

#[test]
fn impossible_counts_in_the_configs_are_errors_not_panics() {
    let (config, speech, _) = fixture("tiny-base");
    let mut bad: serde_json::Value = serde_json::from_str(&config).unwrap();
    bad["talker_config"]["code_predictor_config"]["num_code_groups"] = 0.into();
    let model = ModelConfig::from_json(&bad.to_string()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, &speech).unwrap();
    let codec = SpeechTokenizerConfig::from_file(&path).unwrap();
    let err = expected_tensors(&model, &codec).unwrap_err().to_string();
    assert!(
        err.contains("code_predictor_config.num_code_groups is 0"),
        "{err}"
    );

    let mut bad: serde_json::Value = serde_json::from_str(&speech).unwrap();
    bad["encoder_config"]["compress"] = 0.into();
    std::fs::write(&path, bad.to_string()).unwrap();
    let codec = SpeechTokenizerConfig::from_file(&path).unwrap();
    let model = ModelConfig::from_json(&config).unwrap();
    let err = expected_tensors(&model, &codec).unwrap_err().to_string();
    assert!(err.contains("encoder_config.compress"), "{err}");
}

/// A safetensors file holding the given (name, dtype, shape, little-endian bytes) tensors.
fn write_tensors(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [data.len(), data.len() + bytes.len()],
            }),
        );
        data.extend_from_slice(bytes);
    }
    let json = serde_json::to_vec(&header).unwrap();
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
}

#[test]
fn code_frames_are_read_and_bad_code_tensors_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("codes.safetensors");
    let i64s = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let good: Vec<i64> = (0..32).collect();
    let mut negative = good.clone();
    negative[5] = -1;
    write_tensors(
        &path,
        &[
            ("good", "I64", vec![2, 16], i64s(&good)),
            ("negative", "I64", vec![2, 16], i64s(&negative)),
            ("floats", "F32", vec![1, 16], vec![0; 64]),
            ("narrow", "I64", vec![4, 8], i64s(&good)),
        ],
    );
    let file = SafetensorsFile::open(&path).unwrap();
    let frames = file.frames("good").unwrap();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[1][0], 16);
    assert_eq!(frames[1][15], 31);
    for (name, says) in [
        ("negative", "negative code"),
        ("floats", "F32"),
        ("narrow", "[4, 8]"),
        ("absent", "missing tensor absent"),
    ] {
        let err = format!("{:#}", file.frames(name).unwrap_err());
        assert!(err.contains(says), "{name}: {err}");
    }
}
