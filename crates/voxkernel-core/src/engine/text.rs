//! Text that arrives in pieces (an LLM streaming its reply) turned into talker text ids that
//! never have to be taken back.
//!
//! The Qwen pre-tokenizer splits before whitespace: a space belongs to the word after it, so
//! the ids of everything before the last whitespace cannot change whatever text comes next.
//! Only those are committed; the last word waits for more text or for the end. Two of its
//! patterns reach across whitespace, and [`stable_prefix_len`] steps back over them: a run of
//! whitespace is one piece (`"\n\n"` is one token), and punctuation takes the line breaks after
//! it (`".\n"`) along with one space before it.

use anyhow::Result;

use crate::tokenizer::TextTokenizer;

#[derive(Debug, Default)]
pub struct IncrementalText {
    text: String,
    committed: Vec<u32>,
    finished: bool,
}

impl IncrementalText {
    /// Appends `piece` and returns the ids that became final (possibly none).
    pub fn push(&mut self, tokenizer: &TextTokenizer, piece: &str) -> Result<Vec<u32>> {
        self.text.push_str(piece);
        let Some(cut) = stable_prefix_len(&self.text) else {
            return Ok(Vec::new());
        };
        let stable = if cut == 0 {
            Vec::new()
        } else {
            tokenizer.target_text_ids(&self.text[..cut])?
        };
        Ok(self.commit(stable))
    }

    /// The text is complete: returns the remaining ids.
    ///
    /// If a merge across a piece boundary made the whole-text ids differ from what was already
    /// committed (not seen with the Qwen pre-tokenizer, see the tests), the committed ids stay
    /// and the rest of the whole-text ids follow them; the warning says so.
    pub fn finish(&mut self, tokenizer: &TextTokenizer) -> Result<Vec<u32>> {
        self.finished = true;
        if self.text.is_empty() {
            return Ok(Vec::new());
        }
        let all = tokenizer.target_text_ids(&self.text)?;
        if !all.starts_with(&self.committed) {
            tracing::warn!(
                text = %self.text,
                "streamed text ids differ from the whole text's ids; keeping the streamed ones"
            );
        }
        let rest = all.get(self.committed.len()..).unwrap_or_default().to_vec();
        self.committed.extend_from_slice(&rest);
        Ok(rest)
    }

    fn commit(&mut self, stable: Vec<u32>) -> Vec<u32> {
        if stable.len() <= self.committed.len() || !stable.starts_with(&self.committed) {
            return Vec::new();
        }
        let new = stable[self.committed.len()..].to_vec();
        self.committed = stable;
        new
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every id committed so far.
    pub fn committed(&self) -> &[u32] {
        &self.committed
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

/// Bytes of `text` whose token ids no later text can change: up to the start of the last
/// whitespace run, minus the punctuation (and one space) right before it. `None` without
/// whitespace.
fn stable_prefix_len(text: &str) -> Option<usize> {
    let last_space = text.char_indices().rfind(|(_, c)| c.is_whitespace())?.0;
    let before = |end: usize| text[..end].chars().next_back();
    let mut cut = last_space;
    while let Some(c) = before(cut).filter(|c| c.is_whitespace()) {
        cut -= c.len_utf8();
    }
    let run_end = cut;
    while let Some(c) = before(cut).filter(|c| !c.is_whitespace() && !c.is_alphanumeric()) {
        cut -= c.len_utf8();
    }
    if cut < run_end && before(cut) == Some(' ') {
        cut -= 1;
    }
    Some(cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
        TextTokenizer::from_dir(&dir).unwrap()
    }

    /// Streams `pieces`, checking at each step that nothing committed is ever taken back, and
    /// returns every committed id.
    fn stream(tokenizer: &TextTokenizer, pieces: &[&str]) -> Vec<u32> {
        let mut text = IncrementalText::default();
        let mut out = Vec::new();
        for piece in pieces {
            out.extend(text.push(tokenizer, piece).unwrap());
            assert_eq!(out, text.committed());
        }
        out.extend(text.finish(tokenizer).unwrap());
        out
    }

    #[test]
    fn streamed_ids_equal_whole_text_ids() {
        let tokenizer = tokenizer();
        let cases: &[&[&str]] = &[
            &["Hello", " wor", "ld, how", " are you", "?"],
            &["Hi! ", "How ", "can I ", "help?"],
            &["The price is $1", "23.45 ", "today", "."],
            &["I don", "'t know", ",  really  ", "spaced\n", "\nlines"],
            &["Hello.", "\n", "\nNext", " one !", "\n", "done"],
            &["Tabs\t", "\tand  ", "\n \n", "mixed"],
            &["你好", "，世界。", "今天 ", "天气很好"],
            &["全角\u{3000}空格", "\u{3000}", "と、", "\u{a0}nbsp"],
            &["Don't", " stop", " me now"],
            &["a", "b", "c", " ", "d"],
        ];
        for pieces in cases {
            let whole: String = pieces.concat();
            assert_eq!(
                stream(&tokenizer, pieces),
                tokenizer.target_text_ids(&whole).unwrap(),
                "{pieces:?}"
            );
        }
    }

    #[test]
    fn character_by_character_equals_whole_text() {
        let tokenizer = tokenizer();
        let whole = "Well, it's 3:45pm — shall we go? Yes!  Let's.";
        let pieces: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(
            stream(&tokenizer, &pieces),
            tokenizer.target_text_ids(whole).unwrap()
        );
    }

    #[test]
    fn the_last_word_waits_for_whitespace() {
        let tokenizer = tokenizer();
        let mut text = IncrementalText::default();
        assert!(text.push(&tokenizer, "Hello").unwrap().is_empty());
        assert!(text.push(&tokenizer, "world").unwrap().is_empty());
        let committed = text.push(&tokenizer, " next").unwrap();
        assert_eq!(committed, tokenizer.target_text_ids("Helloworld").unwrap());
        let rest = text.finish(&tokenizer).unwrap();
        assert_eq!(rest, tokenizer.target_text_ids(" next").unwrap());
        assert!(text.is_finished());
    }
}
