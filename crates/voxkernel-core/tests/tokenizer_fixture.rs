//! Parity of `TextTokenizer` with transformers 4.57.3 `Qwen2TokenizerFast` (loaded as by hub
//! id), on the cases of `tests/fixtures/tokenizer/tokenizer_cases.json` written by
//! `scripts/tokenizer/gen_fixture.py`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;
use voxkernel_core::tokenizer::TextTokenizer;

#[derive(Debug, Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
struct Case {
    category: String,
    text: String,
    encode_ids: Vec<u32>,
    target_chat_ids: Vec<u32>,
    target_text_ids: Vec<u32>,
    reference_text_ids: Vec<u32>,
    instruct_ids: Vec<u32>,
    mistral_target_chat_ids: Vec<u32>,
    qwen_pretokens: Vec<String>,
    mistral_pretokens: Vec<String>,
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
}

fn tokenizer() -> &'static TextTokenizer {
    static TOKENIZER: OnceLock<TextTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| TextTokenizer::from_dir(&fixture_dir()).expect("fixture tokenizer"))
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = fixture_dir().join("tokenizer_cases.json");
        let text = std::fs::read_to_string(&path).expect("reading tokenizer_cases.json");
        serde_json::from_str(&text).expect("parsing tokenizer_cases.json")
    })
}

fn case(text: &str) -> &'static Case {
    fixture()
        .cases
        .iter()
        .find(|case| case.text == text)
        .unwrap_or_else(|| panic!("fixture has no case {text:?}"))
}

fn target_chat(text: &str) -> String {
    format!("<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
}

#[test]
fn every_fixture_case_matches_the_official_tokenizer() {
    let tokenizer = tokenizer();
    let cases = &fixture().cases;
    assert!(cases.len() >= 150, "fixture has only {} cases", cases.len());
    let mut mismatches = Vec::new();
    for case in cases {
        let checks: [(&str, Vec<u32>, &Vec<u32>); 5] = [
            (
                "encode",
                tokenizer.encode(&case.text).unwrap(),
                &case.encode_ids,
            ),
            (
                "encode(target chat)",
                tokenizer.encode(&target_chat(&case.text)).unwrap(),
                &case.target_chat_ids,
            ),
            (
                "target_text_ids",
                tokenizer.target_text_ids(&case.text).unwrap(),
                &case.target_text_ids,
            ),
            (
                "reference_text_ids",
                tokenizer.reference_text_ids(&case.text).unwrap(),
                &case.reference_text_ids,
            ),
            (
                "instruct_ids",
                tokenizer.instruct_ids(&case.text).unwrap(),
                &case.instruct_ids,
            ),
        ];
        for (what, got, want) in checks {
            if &got != want {
                mismatches.push(format!(
                    "[{}] {:?} {what}:\n    got  {got:?}\n    want {want:?}",
                    case.category, case.text
                ));
            }
        }
    }
    for mismatch in &mismatches {
        eprintln!("{mismatch}");
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches over {} cases",
        mismatches.len(),
        cases.len()
    );
}

/// The claims of docs/tokenizer.md about the Mistral regex, checked against the ids the
/// official fix_mistral_regex=True local load produced.
#[test]
fn mistral_regex_changes_ids_only_on_the_documented_strings() {
    let ids_differ = |text: &str| {
        let case = case(text);
        case.target_chat_ids != case.mistral_target_chat_ids
    };
    let splits_differ = |text: &str| {
        let case = case(text);
        case.qwen_pretokens != case.mistral_pretokens
    };

    // A lower-case letter before an upper-case one, or an upper-case letter after 's.
    for text in ["iPhone", "iOS", "JavaScript and TypeScript", "'Sup"] {
        assert!(
            ids_differ(text),
            "{text:?} should differ under the Mistral regex"
        );
    }
    // Split differently, but BPE lands on the same ids.
    for text in ["OpenAI", "ChatGPT", "'sup", "he'sgreat", "'tis the season"] {
        assert!(splits_differ(text), "{text:?} should split differently");
        assert!(!ids_differ(text), "{text:?} should keep its ids");
    }

    let documented_differing = [
        "iPhone",
        "I bought a new iPhone yesterday.",
        "JavaScript and TypeScript",
        "YouTube, PayPal, eBay",
        "iOS",
        "DeepSeek and macOS",
        "'Sup",
        "我用iPhone打电话给OpenAI的朋友。",
    ];
    let differing: Vec<&str> = fixture()
        .cases
        .iter()
        .filter(|case| ids_differ(&case.text))
        .map(|case| case.text.as_str())
        .collect();
    assert_eq!(differing, documented_differing);

    // The Rust tokenizer follows the Qwen (hub-id) regex on exactly those strings.
    for text in documented_differing {
        let ids = tokenizer().encode(&target_chat(text)).unwrap();
        assert_eq!(ids, case(text).target_chat_ids, "{text:?}");
        assert_ne!(ids, case(text).mistral_target_chat_ids, "{text:?}");
    }
}

#[test]
fn chat_role_tokens_have_the_spec_ids() {
    let tokenizer = tokenizer();
    let ids = tokenizer.encode(&target_chat("")).unwrap();
    assert_eq!(
        ids,
        [151644, 77091, 198, 151645, 198, 151644, 77091, 198],
        "role prefix [<|im_start|>, assistant, \\n] and suffix"
    );
    let expected = [
        ("<|endoftext|>", 151643),
        ("<|im_start|>", 151644),
        ("<|im_end|>", 151645),
        ("<tool_call>", 151657),
        ("<|audio_start|>", 151669),
        ("<|audio_end|>", 151670),
        ("<tts_pad>", 151671),
        ("<tts_text_bos>", 151672),
        ("<tts_text_eod>", 151673),
        ("<tts_text_bos_single>", 151674),
        ("<|audio_pad|>", 151675),
        ("assistant", 77091),
        ("user", 872),
    ];
    for (token, id) in expected {
        assert_eq!(tokenizer.token_id(token), Some(id), "{token}");
    }
    assert_eq!(tokenizer.token_id("<|no_such_token|>"), None);
}

#[test]
fn slicing_helpers_cut_the_chat_strings_like_the_official_code() {
    let tokenizer = tokenizer();
    let text = "Hello, world!";
    let hello = tokenizer.encode(text).unwrap();

    let target_chat = tokenizer.encode(&target_chat(text)).unwrap();
    assert_eq!(target_chat[..3], [151644, 77091, 198]);
    assert_eq!(
        target_chat[target_chat.len() - 5..],
        [151645, 198, 151644, 77091, 198]
    );
    assert_eq!(tokenizer.target_text_ids(text).unwrap(), hello);

    assert_eq!(tokenizer.reference_text_ids(text).unwrap(), hello);

    let instruct = tokenizer.instruct_ids(text).unwrap();
    let user = tokenizer.token_id("user").unwrap();
    assert_eq!(instruct[..3], [151644, user, 198]);
    assert_eq!(instruct[3..instruct.len() - 2], hello[..]);
    assert_eq!(instruct[instruct.len() - 2..], [151645, 198]);

    // A leading newline merges with the role's newline, so the slice loses it: the official
    // code does the same.
    assert_eq!(tokenizer.target_text_ids("\n").unwrap(), Vec::<u32>::new());
    assert_eq!(tokenizer.target_text_ids("").unwrap(), Vec::<u32>::new());
}

#[test]
fn decode_inverts_encode() {
    let tokenizer = tokenizer();
    for text in ["Hello, world!", "你好，世界！", "👨‍👩‍👧‍👦 <tts_pad> x"] {
        let ids = tokenizer.encode(text).unwrap();
        assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    }
}

fn copy_tokenizer_files(to: &Path, except: &str) {
    for name in ["vocab.json", "merges.txt", "tokenizer_config.json"] {
        if name != except {
            std::fs::copy(fixture_dir().join(name), to.join(name)).unwrap();
        }
    }
}

#[test]
fn a_missing_file_is_named_in_the_error() {
    for missing in ["vocab.json", "merges.txt", "tokenizer_config.json"] {
        let dir = tempfile::tempdir().unwrap();
        copy_tokenizer_files(dir.path(), missing);
        let error = match TextTokenizer::from_dir(dir.path()) {
            Ok(_) => panic!("loading without {missing} should fail"),
            Err(error) => format!("{error:#}"),
        };
        assert!(
            error.contains(missing),
            "error {error:?} does not name {missing}"
        );
    }
}

#[test]
fn a_gap_in_the_added_token_ids_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    copy_tokenizer_files(dir.path(), "tokenizer_config.json");
    let config = std::fs::read_to_string(fixture_dir().join("tokenizer_config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    let added = config["added_tokens_decoder"].as_object_mut().unwrap();
    let eod = added.remove("151673").unwrap();
    added.insert("151700".to_owned(), eod);
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    let error = match TextTokenizer::from_dir(dir.path()) {
        Ok(_) => panic!("a gap in the added token ids should be rejected"),
        Err(error) => format!("{error:#}"),
    };
    // The first token after the gap is the one that lands on the wrong id.
    assert!(
        error.contains("<tts_text_bos_single>") && error.contains("151674"),
        "{error}"
    );
}
