//! The HTTP response formats, encoded as the audio streams in: raw PCM, WAV with an open-ended
//! header, and FLAC (fixed predictors with Rice-coded residuals, or verbatim).

/// 24 kHz mono 16-bit: what every engine session produces.
pub const SAMPLE_RATE: u32 = 24_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AudioFormat {
    Wav,
    Pcm,
    Flac,
}

impl AudioFormat {
    pub fn content_type(self) -> &'static str {
        match self {
            AudioFormat::Wav => "audio/wav",
            AudioFormat::Pcm => "audio/pcm",
            AudioFormat::Flac => "audio/flac",
        }
    }
}

/// Turns PCM chunks into the bytes of one format's stream, header first.
pub enum Encoder {
    Pcm,
    Wav { header_sent: bool },
    Flac(Box<FlacEncoder>),
}

impl Encoder {
    pub fn new(format: AudioFormat) -> Self {
        match format {
            AudioFormat::Pcm => Encoder::Pcm,
            AudioFormat::Wav => Encoder::Wav { header_sent: false },
            AudioFormat::Flac => Encoder::Flac(Box::default()),
        }
    }

    /// The bytes for the next chunk of samples (the stream's header comes with the first).
    pub fn encode(&mut self, pcm: &[i16]) -> Vec<u8> {
        match self {
            Encoder::Pcm => pcm_bytes(pcm),
            Encoder::Wav { header_sent } => {
                let mut out = if *header_sent {
                    Vec::new()
                } else {
                    *header_sent = true;
                    wav_header()
                };
                out.extend(pcm_bytes(pcm));
                out
            }
            Encoder::Flac(flac) => flac.encode(pcm),
        }
    }

    /// The bytes that end the stream (a header if no audio came, FLAC's last short block).
    pub fn finish(&mut self) -> Vec<u8> {
        match self {
            Encoder::Pcm => Vec::new(),
            Encoder::Wav { .. } => self.encode(&[]),
            Encoder::Flac(flac) => flac.finish(),
        }
    }
}

/// Little-endian 16-bit samples.
pub fn pcm_bytes(pcm: &[i16]) -> Vec<u8> {
    pcm.iter().flat_map(|s| s.to_le_bytes()).collect()
}

/// A 44-byte WAV header for a stream whose length is not known yet: both sizes are
/// 0xFFFFFFFF, as streaming servers write them; readers take the data to run to the end.
pub fn wav_header() -> Vec<u8> {
    let unknown = u32::MAX.to_le_bytes();
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(b"RIFF");
    h.extend_from_slice(&unknown);
    h.extend_from_slice(b"WAVEfmt ");
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes()); // PCM
    h.extend_from_slice(&1u16.to_le_bytes()); // mono
    h.extend_from_slice(&SAMPLE_RATE.to_le_bytes());
    h.extend_from_slice(&(SAMPLE_RATE * 2).to_le_bytes()); // bytes per second
    h.extend_from_slice(&2u16.to_le_bytes()); // block align
    h.extend_from_slice(&16u16.to_le_bytes()); // bits per sample
    h.extend_from_slice(b"data");
    h.extend_from_slice(&unknown);
    h
}

/// One audio frame of the engine (80 ms): every FLAC block but the last has this many samples.
pub const FLAC_BLOCK: usize = 1920;

/// A streaming FLAC encoder (RFC 9639) for 24 kHz mono 16-bit audio. STREAMINFO leaves the
/// total length, frame sizes and MD5 unknown (zero), which the format allows for streams.
#[derive(Default)]
pub struct FlacEncoder {
    header_sent: bool,
    pending: Vec<i16>,
    frame_number: u32,
}

impl FlacEncoder {
    pub fn encode(&mut self, pcm: &[i16]) -> Vec<u8> {
        let mut out = self.header();
        self.pending.extend_from_slice(pcm);
        let whole = self.pending.len() / FLAC_BLOCK * FLAC_BLOCK;
        let blocks: Vec<i16> = self.pending.drain(..whole).collect();
        for block in blocks.chunks(FLAC_BLOCK) {
            out.extend(self.frame(block));
        }
        out
    }

    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = self.header();
        if !self.pending.is_empty() {
            let block = std::mem::take(&mut self.pending);
            out.extend(self.frame(&block));
        }
        out
    }

    fn header(&mut self) -> Vec<u8> {
        if self.header_sent {
            return Vec::new();
        }
        self.header_sent = true;
        let mut w = BitWriter::default();
        w.bytes(b"fLaC");
        w.bits(1, 1); // last metadata block
        w.bits(0, 7); // STREAMINFO
        w.bits(34, 24);
        w.bits(FLAC_BLOCK as u64, 16); // min block size (the last block may be shorter)
        w.bits(FLAC_BLOCK as u64, 16); // max block size
        w.bits(0, 24); // min frame size: unknown
        w.bits(0, 24); // max frame size: unknown
        w.bits(SAMPLE_RATE as u64, 20);
        w.bits(0, 3); // channels - 1
        w.bits(15, 5); // bits per sample - 1
        w.bits(0, 36); // total samples: unknown
        w.bytes(&[0; 16]); // MD5: unknown
        w.into_bytes()
    }

    fn frame(&mut self, block: &[i16]) -> Vec<u8> {
        let mut w = BitWriter::default();
        w.bits(0b11_1111_1111_1110, 14); // sync
        w.bits(0, 1);
        w.bits(0, 1); // fixed block size: the header carries the frame number
        w.bits(0b0111, 4); // block size - 1 follows as 16 bits
        w.bits(0b0111, 4); // 24 kHz
        w.bits(0, 4); // mono
        w.bits(0b100, 3); // 16 bits per sample
        w.bits(0, 1);
        w.utf8_number(self.frame_number);
        w.bits(block.len() as u64 - 1, 16);
        let crc = crc8(w.written());
        w.bits(crc as u64, 8);
        subframe(&mut w, block);
        w.align();
        let crc = crc16(w.written());
        w.bits(crc as u64, 16);
        self.frame_number += 1;
        w.into_bytes()
    }
}

/// The smallest of: constant, verbatim, or a fixed predictor of order 0-4 with a Rice-coded
/// residual in 2^p partitions.
fn subframe(w: &mut BitWriter, block: &[i16]) {
    let samples: Vec<i64> = block.iter().map(|&s| s as i64).collect();
    if samples.iter().all(|&s| s == samples[0]) {
        w.bits(0, 1);
        w.bits(0b000000, 6); // CONSTANT
        w.bits(0, 1);
        w.signed(samples[0], 16);
        return;
    }
    let verbatim_bits = 16 * samples.len() as u64;
    let best = (0..=4usize)
        .filter(|&order| order < samples.len())
        .map(|order| {
            let residual = fixed_residual(&samples, order);
            let (bits, rice) = best_rice(&residual, samples.len(), order);
            (16 * order as u64 + bits, order, residual, rice)
        })
        .min_by_key(|&(bits, ..)| bits);
    match best {
        Some((bits, order, residual, rice)) if bits < verbatim_bits => {
            w.bits(0, 1);
            w.bits(0b001000 | order as u64, 6); // FIXED, order
            w.bits(0, 1);
            for &s in &samples[..order] {
                w.signed(s, 16);
            }
            w.bits(0b00, 2); // Rice, 4-bit parameters
            w.bits(rice.order as u64, 4);
            let per = samples.len() >> rice.order;
            let mut at = 0;
            for (i, &k) in rice.params.iter().enumerate() {
                let n = if i == 0 { per - order } else { per };
                w.bits(k as u64, 4);
                for &r in &residual[at..at + n] {
                    let u = fold(r);
                    w.unary(u >> k);
                    w.bits(u & ((1 << k) - 1), k);
                }
                at += n;
            }
        }
        _ => {
            w.bits(0, 1);
            w.bits(0b000001, 6); // VERBATIM
            w.bits(0, 1);
            for &s in &samples {
                w.signed(s, 16);
            }
        }
    }
}

/// The residual of FLAC's fixed predictor of `order` (for samples `order..`).
fn fixed_residual(x: &[i64], order: usize) -> Vec<i64> {
    (order..x.len())
        .map(|n| match order {
            0 => x[n],
            1 => x[n] - x[n - 1],
            2 => x[n] - 2 * x[n - 1] + x[n - 2],
            3 => x[n] - 3 * x[n - 1] + 3 * x[n - 2] - x[n - 3],
            _ => x[n] - 4 * x[n - 1] + 6 * x[n - 2] - 4 * x[n - 3] + x[n - 4],
        })
        .collect()
}

/// Signed residual to the unsigned value Rice codes: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...
fn fold(r: i64) -> u64 {
    if r >= 0 {
        (r as u64) << 1
    } else {
        ((-r as u64) << 1) - 1
    }
}

struct Rice {
    order: u32,
    params: Vec<u32>,
}

/// The cheapest partition order and per-partition parameters, with the residual's size in
/// bits (method and order fields included).
fn best_rice(residual: &[i64], block_len: usize, order: usize) -> (u64, Rice) {
    let folded: Vec<u64> = residual.iter().map(|&r| fold(r)).collect();
    let mut best: Option<(u64, Rice)> = None;
    for p in 0..=4u32 {
        let per = block_len >> p;
        if !block_len.is_multiple_of(1 << p) || per <= order {
            break;
        }
        let mut bits = 2 + 4;
        let mut params = Vec::new();
        let mut at = 0;
        for i in 0..(1usize << p) {
            let n = if i == 0 { per - order } else { per };
            let (cost, k) = rice_param(&folded[at..at + n]);
            bits += 4 + cost;
            params.push(k);
            at += n;
        }
        if best.as_ref().is_none_or(|(b, _)| bits < *b) {
            best = Some((bits, Rice { order: p, params }));
        }
    }
    best.expect("partition order 0 always fits a block longer than the predictor order")
}

/// The Rice parameter (0..=14) that codes `values` in the fewest bits, and that count.
fn rice_param(values: &[u64]) -> (u64, u32) {
    let cost = |k: u32| -> u64 { values.iter().map(|&u| (u >> k) + 1 + k as u64).sum() };
    let mean = values.iter().sum::<u64>() / values.len().max(1) as u64;
    // The optimum sits near log2 of the mean; check around it.
    let guess = (u64::BITS - mean.leading_zeros()).min(14);
    (guess.saturating_sub(2)..=(guess + 1).min(14))
        .map(|k| (cost(k), k))
        .min()
        .expect("a non-empty range")
}

#[derive(Default)]
struct BitWriter {
    bytes: Vec<u8>,
    acc: u64,
    used: u32,
}

impl BitWriter {
    /// The low `n` (<= 32) bits of `value`, most significant first.
    fn bits(&mut self, value: u64, n: u32) {
        if n > 32 {
            self.bits(value >> 32, n - 32);
            self.bits(value & 0xFFFF_FFFF, 32);
            return;
        }
        self.acc = (self.acc << n) | (value & ((1u64 << n) - 1));
        self.used += n;
        while self.used >= 8 {
            self.used -= 8;
            self.bytes.push((self.acc >> self.used) as u8);
        }
        self.acc &= (1u64 << self.used) - 1;
    }

    fn signed(&mut self, value: i64, n: u32) {
        self.bits(value as u64, n);
    }

    /// `q` zeros then a one.
    fn unary(&mut self, mut q: u64) {
        while q >= 32 {
            self.bits(0, 32);
            q -= 32;
        }
        self.bits(1, q as u32 + 1);
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.bits(b as u64, 8);
        }
    }

    /// FLAC's UTF-8-style coding of the frame number.
    fn utf8_number(&mut self, n: u32) {
        let n = n as u64;
        if n < 0x80 {
            return self.bits(n, 8);
        }
        let extra = match n {
            0x80..0x800 => 1,
            0x800..0x1_0000 => 2,
            0x1_0000..0x20_0000 => 3,
            0x20_0000..0x400_0000 => 4,
            _ => 5,
        };
        let lead_marker = (0xFF00u64 >> (extra + 1)) & 0xFF;
        self.bits(lead_marker | (n >> (6 * extra)), 8);
        for i in (0..extra).rev() {
            self.bits(0x80 | ((n >> (6 * i)) & 0x3F), 8);
        }
    }

    fn align(&mut self) {
        if self.used > 0 {
            self.bits(0, 8 - self.used);
        }
    }

    /// Whole bytes written so far (the CRCs cover the frame up to a byte boundary).
    fn written(&self) -> &[u8] {
        debug_assert_eq!(self.used, 0);
        &self.bytes
    }

    fn into_bytes(mut self) -> Vec<u8> {
        self.align();
        self.bytes
    }
}

/// CRC-8, polynomial x^8 + x^2 + x + 1, initial 0 (the frame header's).
fn crc8(data: &[u8]) -> u8 {
    data.iter().fold(0u8, |crc, &b| {
        (0..8).fold(crc ^ b, |c, _| {
            if c & 0x80 != 0 {
                (c << 1) ^ 0x07
            } else {
                c << 1
            }
        })
    })
}

/// CRC-16, polynomial x^16 + x^15 + x^2 + 1, initial 0 (the whole frame's).
fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| {
        (0..8).fold(crc ^ ((b as u16) << 8), |c, _| {
            if c & 0x8000 != 0 {
                (c << 1) ^ 0x8005
            } else {
                c << 1
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_flac(bytes: &[u8]) -> (claxon::metadata::StreamInfo, Vec<i16>) {
        let mut reader = claxon::FlacReader::new(std::io::Cursor::new(bytes)).unwrap();
        let info = reader.streaminfo();
        let samples = reader
            .samples()
            .map(|s| s.unwrap() as i16)
            .collect::<Vec<_>>();
        (info, samples)
    }

    fn flac_stream(chunks: &[Vec<i16>]) -> Vec<u8> {
        let mut encoder = Encoder::new(AudioFormat::Flac);
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend(encoder.encode(chunk));
        }
        out.extend(encoder.finish());
        out
    }

    #[test]
    fn flac_of_speech_like_audio_decodes_exactly_and_is_smaller() {
        // A decaying tone with some noise: the fixed predictors must win over verbatim.
        let pcm: Vec<i16> = (0..FLAC_BLOCK * 5 + 700)
            .map(|i| {
                let t = i as f64 / SAMPLE_RATE as f64;
                let noise = ((i * 7919) % 61) as f64 - 30.0;
                (8000.0 * (2.0 * std::f64::consts::PI * 220.0 * t).sin() * (-t).exp() + noise)
                    as i16
            })
            .collect();
        let bytes = flac_stream(&[pcm[..FLAC_BLOCK].to_vec(), pcm[FLAC_BLOCK..].to_vec()]);
        let (info, decoded) = decode_flac(&bytes);
        assert_eq!(info.sample_rate, 24_000);
        assert_eq!(info.channels, 1);
        assert_eq!(info.bits_per_sample, 16);
        assert_eq!(decoded, pcm);
        assert!(bytes.len() < pcm.len() * 2 * 3 / 4, "{} bytes", bytes.len());
    }

    #[test]
    fn flac_handles_silence_extremes_and_an_empty_stream() {
        let loud: Vec<i16> = (0..FLAC_BLOCK * 2)
            .map(|i| if i % 2 == 0 { i16::MAX } else { i16::MIN })
            .collect();
        let silence = vec![0i16; FLAC_BLOCK];
        let (_, decoded) = decode_flac(&flac_stream(&[loud.clone(), silence.clone()]));
        assert_eq!(decoded, [loud, silence].concat());
        let (_, decoded) = decode_flac(&flac_stream(&[]));
        assert!(decoded.is_empty());
    }

    #[test]
    fn wav_header_describes_24khz_mono_pcm16_of_unknown_length() {
        let mut encoder = Encoder::new(AudioFormat::Wav);
        let first = encoder.encode(&[1, -2]);
        assert_eq!(first.len(), 44 + 4);
        assert_eq!(&first[..4], b"RIFF");
        assert_eq!(&first[8..16], b"WAVEfmt ");
        assert_eq!(
            u32::from_le_bytes(first[24..28].try_into().unwrap()),
            24_000
        );
        assert_eq!(u16::from_le_bytes(first[34..36].try_into().unwrap()), 16);
        assert_eq!(&first[36..40], b"data");
        assert_eq!(&first[40..44], &[0xFF; 4]);
        assert_eq!(&first[44..], &[1, 0, 0xFE, 0xFF]);
        assert_eq!(encoder.encode(&[3]), vec![3, 0]);
        assert!(encoder.finish().is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn flac_round_trips_any_chunking(
            chunks in prop::collection::vec(
                prop::collection::vec(any::<i16>(), 0..2500), 0..5),
            smooth in any::<bool>(),
        ) {
            // Smoothed chunks exercise the predictors; raw ones the verbatim fallback.
            let chunks: Vec<Vec<i16>> = chunks
                .into_iter()
                .map(|c| if smooth {
                    c.iter().scan(0i32, |acc, &s| {
                        *acc = (*acc * 7 + s as i32 / 4) / 8;
                        Some(*acc as i16)
                    }).collect()
                } else { c })
                .collect();
            let (_, decoded) = decode_flac(&flac_stream(&chunks));
            prop_assert_eq!(decoded, chunks.concat());
        }
    }
}
