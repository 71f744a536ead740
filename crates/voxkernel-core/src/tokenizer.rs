//! The Qwen2 byte-level BPE text tokenizer, built from `vocab.json` + `merges.txt` +
//! `tokenizer_config.json` (the released repositories ship no `tokenizer.json`).
//!
//! The pipeline mirrors what transformers 4.57.3 builds for `Qwen2TokenizerFast` through
//! `Qwen2Converter` when it is loaded by hub id: NFC, the Qwen split regex, byte-level BPE and
//! the added tokens of `tokenizer_config.json`. The Mistral regex that `fix_mistral_regex=True`
//! swaps in for some local directories is deliberately NOT reproduced; `docs/tokenizer.md`
//! explains why and lists the strings on which the two differ.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// The pre-tokenizer split of `Qwen2Converter` (transformers 4.57.3,
/// `convert_slow_tokenizer.py`), applied with the "isolated" behaviour.
pub const QWEN_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const VOCAB_FILE: &str = "vocab.json";
const MERGES_FILE: &str = "merges.txt";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Tokens of `"<|im_start|>assistant\n"` that precede the text in the target and reference
/// chat strings.
const ASSISTANT_PREFIX_LEN: usize = 3;
/// Tokens of `"<|im_end|>\n<|im_start|>assistant\n"` that follow the target text.
const TARGET_SUFFIX_LEN: usize = 5;
/// Tokens of `"<|im_end|>\n"` that follow the reference text.
const REFERENCE_SUFFIX_LEN: usize = 2;

/// The error detail for text without a speakable character, after the field's name.
pub const NOTHING_TO_SPEAK: &str =
    "empty, or only whitespace and invisible characters; give the text to speak";

/// Whether `text` has anything to say: a character that is neither whitespace nor invisible.
///
/// Text of zero-width spaces, joiners, soft hyphens, byte-order marks or variation selectors
/// still tokenizes to ids, and the talker would speak those ids as noise until it stops; a
/// request made only of them is as empty as one made only of spaces. The invisible set is
/// Unicode's default-ignorable code points.
pub fn has_speakable_text(text: &str) -> bool {
    text.chars()
        .any(|c| !c.is_whitespace() && !is_default_ignorable(c))
}

fn is_default_ignorable(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{034F}'
            | '\u{061C}'
            | '\u{115F}'..='\u{1160}'
            | '\u{17B4}'..='\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{200B}'..='\u{200F}'
            | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{206F}'
            | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FEFF}'
            | '\u{FFA0}'
            | '\u{FFF0}'..='\u{FFF8}'
            | '\u{1BCA0}'..='\u{1BCA3}'
            | '\u{1D173}'..='\u{1D17A}'
            | '\u{E0000}'..='\u{E0FFF}'
    )
}

/// One entry of `added_tokens_decoder` in `tokenizer_config.json`.
#[derive(Debug, Deserialize)]
struct AddedTokenEntry {
    content: String,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    normalized: bool,
    #[serde(default)]
    special: bool,
}

#[derive(Debug, Deserialize)]
struct TokenizerConfigFile {
    #[serde(default)]
    added_tokens_decoder: BTreeMap<String, AddedTokenEntry>,
}

/// The Qwen3-TTS text tokenizer.
pub struct TextTokenizer {
    tokenizer: Tokenizer,
}

impl TextTokenizer {
    /// Builds the tokenizer from the three tokenizer files of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let vocab = read_vocab(&dir.join(VOCAB_FILE))?;
        let merges = read_merges(&dir.join(MERGES_FILE))?;
        let added_tokens = read_added_tokens(&dir.join(TOKENIZER_CONFIG_FILE))?;

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| anyhow!("building the BPE model from {}: {e}", dir.display()))?;
        let split = Split::new(
            SplitPattern::Regex(QWEN_SPLIT_REGEX.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("compiling the Qwen split regex: {e}"))?;
        // The regex already split the text, so ByteLevel only maps bytes to its alphabet.
        let byte_level = ByteLevel::new(false, true, false);

        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer
            .with_normalizer(Some(NFC))
            .map_err(|e| anyhow!("setting the NFC normalizer: {e}"))?;
        tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));
        tokenizer.with_decoder(Some(byte_level));
        add_tokens_in_id_order(&mut tokenizer, added_tokens, dir)?;
        Ok(Self { tokenizer })
    }

    /// Token ids of `s` with no special tokens added. Added-token literals inside `s`
    /// (`<|im_end|>`, `<tts_pad>`, ...) become their single ids, as in the HF tokenizer.
    pub fn encode(&self, s: &str) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(s, false)
            .map_err(|e| anyhow!("tokenizing {s:?}: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text ids of the target text: `[3:-5]` of the full assistant chat string. Tokenizing the
    /// whole string (not `text` alone) keeps the merges across the boundaries that the
    /// official code gets, e.g. a leading `\n` joins the role's `\n`.
    pub fn target_text_ids(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self.target_chat_ids(text)?;
        Ok(python_slice(&ids, ASSISTANT_PREFIX_LEN, TARGET_SUFFIX_LEN))
    }

    /// `[0:3]` of the same string: the role prefix the official prefill carries. It is
    /// `<|im_start|> assistant \n` unless the text starts with a line break that merges
    /// into the role's `\n`.
    pub fn target_role_ids(&self, text: &str) -> Result<[u32; 3]> {
        let ids = self.target_chat_ids(text)?;
        ids.get(..ASSISTANT_PREFIX_LEN)
            .and_then(|role| role.try_into().ok())
            .ok_or_else(|| anyhow!("tokenizing {text:?}: the chat string has under 3 ids"))
    }

    fn target_chat_ids(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(&format!(
            "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
        ))
    }

    /// Text ids of the ICL reference transcript: `[3:-2]` of its assistant chat string.
    pub fn reference_text_ids(&self, ref_text: &str) -> Result<Vec<u32>> {
        let ids = self.encode(&format!("<|im_start|>assistant\n{ref_text}<|im_end|>\n"))?;
        Ok(python_slice(
            &ids,
            ASSISTANT_PREFIX_LEN,
            REFERENCE_SUFFIX_LEN,
        ))
    }

    /// All ids of the user chat string that carries the instruct.
    pub fn instruct_ids(&self, instruct: &str) -> Result<Vec<u32>> {
        self.encode(&format!("<|im_start|>user\n{instruct}<|im_end|>\n"))
    }

    /// Id of a vocabulary or added token, e.g. `"<tts_pad>"`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding {} ids: {e}", ids.len()))
    }
}

/// `ids[start:-from_end]` with Python's clamping: a range that ends up empty or inverted
/// gives no ids instead of a panic.
fn python_slice(ids: &[u32], start: usize, from_end: usize) -> Vec<u32> {
    let end = ids.len().saturating_sub(from_end);
    ids.get(start..end).unwrap_or_default().to_vec()
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("reading tokenizer file {}", path.display()))
}

fn read_vocab(path: &Path) -> Result<Vocab> {
    serde_json::from_str(&read_file(path)?).with_context(|| {
        format!(
            "{}: expected a JSON object mapping token strings to ids",
            path.display()
        )
    })
}

/// Parses `merges.txt` the way `Qwen2Tokenizer.__init__` does: an optional `#version:` first
/// line and blank lines are skipped, every other line is two space-separated symbols.
fn read_merges(path: &Path) -> Result<Merges> {
    let text = read_file(path)?;
    let mut merges = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (index == 0 && line.starts_with("#version:")) {
            continue;
        }
        let mut symbols = line.split_whitespace();
        match (symbols.next(), symbols.next(), symbols.next()) {
            (Some(left), Some(right), None) => merges.push((left.to_owned(), right.to_owned())),
            _ => bail!(
                "{} line {}: expected two space-separated symbols, got {line:?}",
                path.display(),
                index + 1
            ),
        }
    }
    Ok(merges)
}

fn read_added_tokens(path: &Path) -> Result<BTreeMap<u32, AddedTokenEntry>> {
    let config: TokenizerConfigFile = serde_json::from_str(&read_file(path)?)
        .with_context(|| format!("{}: invalid tokenizer config", path.display()))?;
    config
        .added_tokens_decoder
        .into_iter()
        .map(|(id, entry)| {
            let id = id.parse::<u32>().with_context(|| {
                format!(
                    "{}: added_tokens_decoder key {id:?} is not a token id",
                    path.display()
                )
            })?;
            Ok((id, entry))
        })
        .collect()
}

/// Adds the tokens one by one in id order, because the `tokenizers` crate gives each new
/// token the next free id; the check afterwards catches a config whose ids leave gaps.
fn add_tokens_in_id_order(
    tokenizer: &mut Tokenizer,
    added_tokens: BTreeMap<u32, AddedTokenEntry>,
    dir: &Path,
) -> Result<()> {
    for (id, entry) in added_tokens {
        let token = AddedToken::from(entry.content.clone(), entry.special)
            .lstrip(entry.lstrip)
            .rstrip(entry.rstrip)
            .single_word(entry.single_word)
            .normalized(entry.normalized);
        let added = if entry.special {
            tokenizer.add_special_tokens([token])
        } else {
            tokenizer.add_tokens([token])
        };
        added.map_err(|e| anyhow!("adding token {:?}: {e}", entry.content))?;
        let assigned = tokenizer.token_to_id(&entry.content);
        if assigned != Some(id) {
            bail!(
                "{}: added token {:?} is declared with id {id} but got {assigned:?}; \
                 added_tokens_decoder ids must continue the vocab.json ids without gaps",
                dir.join(TOKENIZER_CONFIG_FILE).display(),
                entry.content
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{has_speakable_text, python_slice};

    #[test]
    fn only_whitespace_or_invisible_characters_have_nothing_to_speak() {
        for blank in [
            "",
            " \t\n",
            "\u{200B}",
            "\u{00A0}\u{FEFF}",
            " \u{200D}\u{2060}\u{00AD} ",
            "\u{FE0F}\u{E0041}",
        ] {
            assert!(!has_speakable_text(blank), "{blank:?}");
        }
        for speakable in [
            "a",
            " \u{200B}hi",
            "\u{4F60}",
            "\u{1F600}",
            "1",
            ".",
            "a\u{FE0F}",
        ] {
            assert!(has_speakable_text(speakable), "{speakable:?}");
        }
    }

    #[test]
    fn python_slice_matches_python_semantics() {
        let ids: Vec<u32> = (0..10).collect();
        assert_eq!(python_slice(&ids, 3, 5), vec![3, 4]);
        assert_eq!(python_slice(&ids, 3, 2), vec![3, 4, 5, 6, 7]);
        // Python: list(range(8))[3:-5] == [] and list(range(7))[3:-5] == [].
        assert!(python_slice(&ids[..8], 3, 5).is_empty());
        assert!(python_slice(&ids[..7], 3, 5).is_empty());
        assert!(python_slice(&[], 3, 5).is_empty());
    }
}
