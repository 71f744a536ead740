//! Sampling parameters and the official sampling order (qwen3-tts-spec.md §3.7), plus the
//! counter-based random numbers every backend must share.
//!
//! # The official order (transformers 4.57.3 `GenerationMixin._sample`)
//!
//! Logits are fp32. The talker (codebook 0) applies, in this order:
//! 1. repetition penalty over the *unique* codebook-0 ids generated so far
//!    (`x < 0 ? x * p : x / p`, once per id);
//! 2. EOS masked (`-inf`) while fewer than `min_new_tokens` (2) tokens have been generated;
//! 3. ids `vocab_size - 1024 .. vocab_size` suppressed (`-inf`) except EOS;
//! 4. only when sampling: temperature, top-k, top-p (only if `top_p < 1`);
//! 5. sampling: softmax and one multinomial draw; greedy: argmax (first index on ties) of the
//!    scores after steps 1-3.
//!
//! The sub-talker (codebooks 1..15) skips steps 1-3 and uses its own temperature, top-k, top-p.
//!
//! # Random numbers (mirror this exactly in every backend)
//!
//! Each draw is one uniform `u` in `[0, 1)` from Philox4x32-10 (Salmon et al., SC'11; the
//! Random123 reference, checked against its known-answer vectors in the tests below):
//! - key = `[seed as u32, (seed >> 32) as u32]`;
//! - counter = `[frame, group, 0, 0]` where `frame` is the 0-based index of the frame the token
//!   belongs to (codebook 0 of frame 0 comes from the prefill, codebook 0 of frame `f + 1` from
//!   talker decode step `f`) and `group` is the codebook (0 = talker, 1..15 = sub-talker);
//! - `u = (word0 >> 8) * 2^-24`, where `word0` is the first output word (24 bits, exact in f32).
//!
//! The token is chosen by inverse CDF in vocabulary order: with the probabilities `p_i` of the
//! softmax (f32), accumulate `p_i` in f64 over ids with `p_i > 0` and return the first id whose
//! running sum exceeds `u * sum_i p_i` (f64); if rounding leaves none, the last id with `p_i > 0`.

use std::ops::Range;

use anyhow::{Result, bail};
use serde::Serialize;

use crate::config::GenerationConfig;

/// Parameters of one sampler: the talker (codebook 0) or the sub-talker (codebooks 1..15).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SamplerParams {
    /// `false` means greedy (argmax after the logit processors).
    pub do_sample: bool,
    pub temperature: f32,
    /// 0 keeps every logit: transformers' `generate` adds no top-k warper for `top_k=0`.
    pub top_k: usize,
    pub top_p: f32,
    /// Only the talker uses it; the sub-talker's is always 1.0.
    pub repetition_penalty: f32,
}

impl SamplerParams {
    /// Rejects values transformers would reject or silently misuse. `field` renders a
    /// parameter's user-facing name (a CLI flag or a JSON field) for the error.
    pub fn validate(&self, field: impl Fn(&str) -> String) -> Result<()> {
        if self.do_sample && !(self.temperature > 0.0 && self.temperature.is_finite()) {
            bail!(
                "{} must be a finite number > 0 when sampling (greedy decoding ignores it), got {}",
                field("temperature"),
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("{} must be in (0, 1], got {}", field("top_p"), self.top_p);
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            bail!(
                "{} must be a finite number > 0, got {}",
                field("repetition_penalty"),
                self.repetition_penalty
            );
        }
        Ok(())
    }
}

/// Sampling for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SamplingConfig {
    pub talker: SamplerParams,
    pub subtalker: SamplerParams,
    /// Seeds the per-sequence counter-based RNG, so a run is reproducible.
    pub seed: u64,
}

impl SamplingConfig {
    /// The checkpoint's `generation_config.json` defaults (the wrapper's merge, spec §1.5).
    pub fn from_generation(generation: &GenerationConfig, seed: u64) -> Self {
        Self {
            talker: SamplerParams {
                do_sample: generation.do_sample,
                temperature: generation.temperature,
                top_k: generation.top_k,
                top_p: generation.top_p,
                repetition_penalty: generation.repetition_penalty,
            },
            subtalker: SamplerParams {
                do_sample: generation.subtalker_dosample,
                temperature: generation.subtalker_temperature,
                top_k: generation.subtalker_top_k,
                top_p: generation.subtalker_top_p,
                repetition_penalty: 1.0,
            },
            seed,
        }
    }

    /// Validates both samplers, naming fields as `talker.top_k` / `subtalker.top_k`.
    pub fn validate(&self) -> Result<()> {
        self.talker.validate(|f| format!("talker.{f}"))?;
        self.subtalker.validate(|f| format!("subtalker.{f}"))
    }
}

/// The model-fixed rules of codebook-0 sampling (not chosen by the request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TalkerLogitRules {
    pub eos_id: u32,
    /// EOS is masked while fewer than this many tokens have been generated.
    pub min_new_tokens: usize,
    /// Suppressed ids (control, language and speaker rows); EOS is exempt.
    pub suppressed: Range<usize>,
}

impl TalkerLogitRules {
    /// The rules `Qwen3TTSForConditionalGeneration.generate` passes (modeling_qwen3_tts.py:2043-2063).
    pub fn official(vocab_size: usize, eos_id: u32) -> Self {
        Self {
            eos_id,
            min_new_tokens: 2,
            suppressed: vocab_size.saturating_sub(1024)..vocab_size,
        }
    }
}

/// `RepetitionPenaltyLogitsProcessor`: each distinct previous id once, sign-dependent.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = std::collections::BTreeSet::new();
    for &id in history {
        if !seen.insert(id) {
            continue;
        }
        let x = &mut logits[id as usize];
        *x = if *x < 0.0 { *x * penalty } else { *x / penalty };
    }
}

/// `MinNewTokensLengthLogitsProcessor`.
pub fn mask_eos_before_min_tokens(logits: &mut [f32], rules: &TalkerLogitRules, generated: usize) {
    if generated < rules.min_new_tokens {
        logits[rules.eos_id as usize] = f32::NEG_INFINITY;
    }
}

/// `SuppressTokensLogitsProcessor` over the control rows, EOS exempt.
pub fn suppress_control_tokens(logits: &mut [f32], rules: &TalkerLogitRules) {
    for id in rules.suppressed.clone() {
        if id != rules.eos_id as usize {
            logits[id] = f32::NEG_INFINITY;
        }
    }
}

/// `TemperatureLogitsWarper`.
pub fn apply_temperature(logits: &mut [f32], temperature: f32) {
    for x in logits.iter_mut() {
        *x /= temperature;
    }
}

/// `TopKLogitsWarper`: keep every logit >= the k-th largest, so ties at the boundary survive.
pub fn top_k_filter(logits: &mut [f32], k: usize) {
    if k == 0 || k >= logits.len() {
        return;
    }
    let mut sorted = logits.to_vec();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let kth = sorted[k - 1];
    for x in logits.iter_mut() {
        if *x < kth {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// `TopPLogitsWarper` (only meaningful for `top_p < 1`): sort ascending, remove the tokens whose
/// cumulative probability is `<= 1 - top_p`, always keep the most likely one. Equal logits are
/// ordered by id so the result is deterministic.
pub fn top_p_filter(logits: &mut [f32], top_p: f32) {
    if top_p >= 1.0 {
        return;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(a.cmp(&b)));
    let sorted: Vec<f32> = order.iter().map(|&i| logits[i]).collect();
    let probs = softmax(&sorted);
    let mut cumulative = 0.0f32;
    let last = order.len() - 1;
    for (rank, (&id, p)) in order.iter().zip(probs).enumerate() {
        cumulative += p;
        if cumulative <= 1.0 - top_p && rank != last {
            logits[id] = f32::NEG_INFINITY;
        }
    }
}

/// Numerically stable softmax in f32; `-inf` logits get probability 0.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// First index of the largest value (torch.argmax's tie rule).
pub fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in scores.iter().enumerate() {
        if x > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// One multinomial draw by inverse CDF in vocabulary order (see the module docs).
pub fn sample_inverse_cdf(probs: &[f32], u: f32) -> u32 {
    let total: f64 = probs.iter().map(|&p| f64::from(p)).sum();
    let target = f64::from(u) * total;
    let mut running = 0.0f64;
    let mut last_positive = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            running += f64::from(p);
            last_positive = i;
            if target < running {
                return i as u32;
            }
        }
    }
    last_positive as u32
}

/// The warpers and the final choice shared by both samplers.
fn choose(logits: &mut [f32], params: &SamplerParams, u: f32) -> u32 {
    if !params.do_sample {
        return argmax(logits);
    }
    apply_temperature(logits, params.temperature);
    top_k_filter(logits, params.top_k);
    top_p_filter(logits, params.top_p);
    sample_inverse_cdf(&softmax(logits), u)
}

/// Chooses codebook 0. `history` holds the codebook-0 ids generated so far for this sequence.
pub fn sample_talker(
    logits: &mut [f32],
    history: &[u32],
    rules: &TalkerLogitRules,
    params: &SamplerParams,
    u: f32,
) -> u32 {
    apply_repetition_penalty(logits, history, params.repetition_penalty);
    mask_eos_before_min_tokens(logits, rules, history.len());
    suppress_control_tokens(logits, rules);
    choose(logits, params, u)
}

/// Chooses one of codebooks 1..15.
pub fn sample_subtalker(logits: &mut [f32], params: &SamplerParams, u: f32) -> u32 {
    choose(logits, params, u)
}

/// The uniform draw for codebook `group` of frame `frame` (see the module docs).
pub fn uniform(seed: u64, frame: u32, group: u32) -> f32 {
    let key = [seed as u32, (seed >> 32) as u32];
    let word0 = philox4x32_10([frame, group, 0, 0], key)[0];
    (word0 >> 8) as f32 * (1.0 / 16_777_216.0)
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: the round function is applied with the current key, and the key
/// is bumped by the Weyl constants between rounds.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(do_sample: bool, temperature: f32, top_k: usize, top_p: f32) -> SamplerParams {
        SamplerParams {
            do_sample,
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.0,
        }
    }

    /// Random123 `tests/kat_vectors`, the three `philox4x32 10` lines (counter, key, result).
    #[test]
    fn philox_matches_random123_known_answers() {
        let cases = [
            (
                [0u32; 4],
                [0u32; 2],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ];
        for (counter, key, expected) in cases {
            assert_eq!(philox4x32_10(counter, key), expected);
        }
    }

    #[test]
    fn uniform_is_in_unit_interval_and_keyed_by_seed_frame_group() {
        let a = uniform(7, 3, 5);
        assert!((0.0..1.0).contains(&a));
        assert_eq!(a, uniform(7, 3, 5));
        assert_ne!(a, uniform(8, 3, 5));
        assert_ne!(a, uniform(7, 4, 5));
        assert_ne!(a, uniform(7, 3, 6));
        // word0 of the all-zero KAT is 0x6627e8d5
        assert_eq!(uniform(0, 0, 0), (0x6627e8d5u32 >> 8) as f32 / 16_777_216.0);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_once_per_id() {
        let mut logits = vec![2.0, -2.0, 1.0, 0.0];
        apply_repetition_penalty(&mut logits, &[0, 1, 0, 0, 3], 2.0);
        assert_eq!(logits, vec![1.0, -4.0, 1.0, 0.0]);
    }

    #[test]
    fn eos_is_masked_until_two_tokens_were_generated() {
        let rules = TalkerLogitRules::official(3072, 2150);
        for (generated, masked) in [(0, true), (1, true), (2, false), (5, false)] {
            let mut logits = vec![0.0; 3072];
            mask_eos_before_min_tokens(&mut logits, &rules, generated);
            assert_eq!(
                logits[2150] == f32::NEG_INFINITY,
                masked,
                "generated {generated}"
            );
        }
    }

    #[test]
    fn suppression_covers_control_rows_except_eos() {
        let rules = TalkerLogitRules::official(3072, 2150);
        let mut logits = vec![1.0; 3072];
        suppress_control_tokens(&mut logits, &rules);
        let suppressed: Vec<usize> = (0..3072)
            .filter(|&i| logits[i] == f32::NEG_INFINITY)
            .collect();
        assert_eq!(suppressed.len(), 1023);
        assert_eq!(suppressed[0], 2048);
        assert_eq!(*suppressed.last().unwrap(), 3071);
        assert_eq!(logits[2150], 1.0);
        assert_eq!(logits[2047], 1.0);
    }

    #[test]
    fn greedy_talker_still_applies_penalty_mask_and_suppression() {
        let rules = TalkerLogitRules::official(3072, 2150);
        let mut logits = vec![0.0; 3072];
        logits[3000] = 9.0; // a control row: suppressed
        logits[2150] = 8.0; // EOS: masked for the first two tokens
        logits[5] = 3.0; // penalized below id 6
        logits[6] = 2.9;
        let mut p = params(false, 1.0, 50, 1.0);
        p.repetition_penalty = 1.05;
        assert_eq!(sample_talker(&mut logits.clone(), &[5], &rules, &p, 0.5), 6);
        assert_eq!(sample_talker(&mut logits, &[5, 6], &rules, &p, 0.5), 2150);
    }

    #[test]
    fn top_k_keeps_ties_at_the_boundary() {
        let mut logits = vec![5.0, 3.0, 3.0, 3.0, 1.0];
        top_k_filter(&mut logits, 2);
        assert_eq!(logits[..4], [5.0, 3.0, 3.0, 3.0]);
        assert_eq!(logits[4], f32::NEG_INFINITY);
    }

    #[test]
    fn top_k_zero_is_accepted_and_keeps_every_logit() {
        let p = params(true, 0.9, 0, 1.0);
        p.validate(|f| f.to_string()).unwrap();
        let logits: Vec<f32> = (0..100).map(|i| i as f32 * 0.01).collect();
        let whole = params(true, 0.9, logits.len(), 1.0);
        let mut low = 0;
        for frame in 0..200 {
            let u = uniform(3, frame, 1);
            let id = sample_subtalker(&mut logits.clone(), &p, u);
            assert_eq!(id, sample_subtalker(&mut logits.clone(), &whole, u));
            low += usize::from(id < 50);
        }
        assert!(
            low > 0,
            "top_k 0 must not filter: no draw below id 50 in 200"
        );
    }

    #[test]
    fn top_p_removes_the_low_tail_and_keeps_at_least_one() {
        // probabilities 0.5, 0.25, 0.125, 0.125 (ids 0..4)
        let base: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125]
            .iter()
            .map(|p| p.ln())
            .collect();
        let mut logits = base.clone();
        top_p_filter(&mut logits, 0.7);
        // ascending cumulative: 0.125, 0.25, 0.5, 1.0 -> remove <= 0.3: ids 2 and 3
        assert!(logits[0].is_finite() && logits[1].is_finite());
        assert_eq!(logits[2], f32::NEG_INFINITY);
        assert_eq!(logits[3], f32::NEG_INFINITY);
        let mut tiny = base;
        top_p_filter(&mut tiny, 1e-6);
        assert_eq!(tiny.iter().filter(|x| x.is_finite()).count(), 1);
        assert!(tiny[0].is_finite());
    }

    #[test]
    fn temperature_divides_logits() {
        let mut logits = vec![1.0, -2.0];
        apply_temperature(&mut logits, 0.5);
        assert_eq!(logits, vec![2.0, -4.0]);
    }

    #[test]
    fn inverse_cdf_walks_the_vocabulary_in_order() {
        let probs = [0.0, 0.25, 0.0, 0.5, 0.25];
        assert_eq!(sample_inverse_cdf(&probs, 0.0), 1);
        assert_eq!(sample_inverse_cdf(&probs, 0.2499), 1);
        assert_eq!(sample_inverse_cdf(&probs, 0.25), 3);
        assert_eq!(sample_inverse_cdf(&probs, 0.7499), 3);
        assert_eq!(sample_inverse_cdf(&probs, 0.75), 4);
        assert_eq!(sample_inverse_cdf(&probs, 0.999_999_9), 4);
    }

    #[test]
    fn sampling_never_picks_a_filtered_token() {
        let logits: Vec<f32> = (0..100).map(|i| i as f32 * 0.1).collect();
        let p = params(true, 0.9, 5, 1.0);
        for frame in 0..200 {
            let id = sample_subtalker(&mut logits.clone(), &p, uniform(1, frame, 1));
            assert!(id >= 95, "top-5 must keep ids 95..100, got {id}");
        }
    }

    #[test]
    fn validate_rejects_bad_values_naming_the_field() {
        let talker = |f: &str| format!("talker.{f}");
        let err = params(true, 0.0, 50, 1.0).validate(talker).unwrap_err();
        assert!(err.to_string().contains("talker.temperature"), "{err}");
        let err = params(false, 1.0, 50, 0.0)
            .validate(|f| format!("subtalker.{f}"))
            .unwrap_err();
        assert!(err.to_string().contains("subtalker.top_p"), "{err}");
        let no_penalty = SamplerParams {
            repetition_penalty: 0.0,
            ..params(true, 1.0, 50, 1.0)
        };
        let err = no_penalty
            .validate(|f| format!("--{}", f.replace('_', "-")))
            .unwrap_err();
        assert!(err.to_string().contains("--repetition-penalty"), "{err}");
        assert!(params(false, 0.0, 1, 1.0).validate(talker).is_ok());
    }
}
