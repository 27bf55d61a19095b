//! Text to token ids and back: the [`Tokenizer`] trait and [`ByteTokenizer`], the default.
//!
//! Guarantee: [`ByteTokenizer`] round-trips any UTF-8 text losslessly
//! (`decode(encode(s)) == s`), never emits a special id from `encode` and never fails. The other
//! implementation, [`HfTokenizer`](super::HfTokenizer), reads a Hugging Face model's tokenizer
//! files; its encoding and decoding can fail, hence the `Result`s.

use super::TextError;

/// Encodes text as token ids and decodes ids back to text.
pub trait Tokenizer: Send + Sync {
    /// The ids of `text`, without special tokens added. An error names the tokenizer and why.
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError>;
    /// The text of `ids`. Special ids and ids outside the vocabulary are skipped; bytes that do not
    /// form UTF-8 (a model's partial output) become U+FFFD. An error names the tokenizer and why.
    fn decode(&self, ids: &[u32]) -> Result<String, TextError>;
    /// The number of ids, special ones included.
    fn vocab_size(&self) -> usize;
    /// Beginning of sequence: the id a sequence starts with, if the model uses one (Llama 3 does,
    /// Qwen does not).
    fn bos(&self) -> Option<u32>;
    /// End of sequence: what a sample ends with.
    fn eos(&self) -> u32;
    /// Every id that ends generation: EOS and the model's end-of-turn ids (Llama 3's
    /// `<|eot_id|>` and `<|end_of_text|>`, Qwen's `<|im_end|>` and `<|endoftext|>`).
    fn stop_ids(&self) -> Vec<u32> {
        vec![self.eos()]
    }
    /// Padding.
    fn pad(&self) -> u32;
}

/// Bytes 0–255 are ids 0–255; then BOS (256), EOS (257) and PAD (258).
///
/// ```
/// use odc_text::{ByteTokenizer, Tokenizer};
/// let t = ByteTokenizer;
/// assert_eq!(t.encode("hi")?, vec![104, 105]);
/// assert_eq!(t.decode(&[ByteTokenizer::BOS, 104, 105, t.eos()])?, "hi");
/// assert_eq!((t.bos(), t.stop_ids()), (Some(256), vec![257]));
/// # Ok::<(), odc_text::TextError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Beginning of sequence.
    pub const BOS: u32 = 256;
    /// End of sequence.
    pub const EOS: u32 = 257;
    /// Padding.
    pub const PAD: u32 = 258;
    /// Bytes plus the three special ids.
    pub const VOCAB_SIZE: usize = 259;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        let bytes: Vec<u8> = ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn bos(&self) -> Option<u32> {
        Some(Self::BOS)
    }

    fn eos(&self) -> u32 {
        Self::EOS
    }

    fn pad(&self) -> u32 {
        Self::PAD
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn byte_round_trip_is_lossless_for_any_utf8(text in any::<String>()) {
            let t = ByteTokenizer;
            let ids = t.encode(&text).expect("the byte tokenizer never fails");
            prop_assert_eq!(ids.len(), text.len());
            prop_assert!(ids.iter().all(|&id| id < 256), "encode emits no special id");
            prop_assert_eq!(t.decode(&ids).expect("never fails"), text);
        }

        #[test]
        fn byte_decode_never_panics_on_any_ids(ids in proptest::collection::vec(any::<u32>(), 0..64)) {
            let t = ByteTokenizer;
            let bytes: Vec<u8> = ids.iter().filter_map(|&id| u8::try_from(id).ok()).collect();
            prop_assert_eq!(t.decode(&ids).expect("never fails"), String::from_utf8_lossy(&bytes));
        }
    }

    #[test]
    fn byte_special_ids_are_distinct_above_the_bytes_and_skipped_by_decode() {
        let t = ByteTokenizer;
        assert_eq!(t.bos(), Some(ByteTokenizer::BOS));
        assert_eq!(t.stop_ids(), [t.eos()]);
        let specials = [ByteTokenizer::BOS, t.eos(), t.pad()];
        assert_eq!(specials, [256, 257, 258]);
        assert!(specials.iter().all(|&id| (id as usize) < t.vocab_size()));
        assert_eq!(t.vocab_size(), 259);
        let mut ids = vec![ByteTokenizer::BOS];
        ids.extend(t.encode("é #### 7").expect("never fails"));
        ids.extend([t.eos(), t.pad(), t.pad(), 1_000_000]);
        assert_eq!(t.decode(&ids).expect("never fails"), "é #### 7");
    }
}
