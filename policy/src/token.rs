//! Assignment tokens: what binds a trainer's report and its gradient writes to the assignment
//! they answer (docs/design.md "Security model").
//!
//! Every [`Assignment`](crate::assignment::Assignment) carries the token of its (epoch,
//! micro-batch): the first 128 bits of HMAC-SHA256(job key, `"odc/assignment"` ‖ epoch (u64 LE) ‖
//! micro-batch (u32 LE)). The trainer echoes it in its report and in every gradient write of
//! that micro-batch; the supervisor checks the report ([`StepMachine`](super::step::StepMachine)),
//! every shard server checks each write (its accumulators' admission guard).
//!
//! Guarantees:
//! - **Unguessable**: the [`JobKey`] is 32 random bytes the supervisor draws when it starts; it
//!   goes to the shard servers (in their spec) and to nobody else, trainers included. Without it
//!   a token is a 128-bit guess, and a token reveals nothing about the token of another epoch or
//!   micro-batch (HMAC is a PRF). So a peer, even an authenticated one, can report or write only
//!   the micro-batches it was given.
//! - **Deterministic**: the same key, epoch and micro-batch give the same token, so the
//!   supervisor and every server compute it independently (no table to keep or to ship); a new
//!   epoch (a replay, the next step) gives every micro-batch new tokens.
//! - **Pure**: no randomness and no clock here; the key comes in from the actor.
//!
//! What it does not do: a trainer can still corrupt the micro-batches it was legitimately given
//! (that is the non-finite gradient check's business), and messages between trainers (the
//! collective ring's inbox sends) carry no checked token.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Domain separation: a token is never another protocol's MAC under the same key.
const LABEL: &[u8] = b"odc/assignment";

/// The job's token key: 32 bytes drawn at random by the supervisor when it starts. Its `Debug`
/// prints no byte of it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobKey([u8; JobKey::LEN]);

impl JobKey {
    /// Bytes in a key.
    pub const LEN: usize = 32;

    /// A key from its bytes (the caller draws them from a cryptographic random source).
    pub const fn from_bytes(bytes: [u8; Self::LEN]) -> Self {
        JobKey(bytes)
    }

    /// The token of micro-batch `micro_batch` of the attempt at accumulator epoch `epoch`.
    ///
    /// ```
    /// use odc_policy::token::JobKey;
    /// let key = JobKey::from_bytes([7; 32]);
    /// assert_eq!(key.token(3, 1), key.token(3, 1));
    /// assert_ne!(key.token(3, 1), key.token(4, 1));
    /// assert!(key.admits(3, 1, key.token(3, 1)));
    /// ```
    pub fn token(&self, epoch: u64, micro_batch: u32) -> u128 {
        let mut mac = match Hmac::<Sha256>::new_from_slice(&self.0) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC accepts any key length"),
        };
        mac.update(LABEL);
        mac.update(&epoch.to_le_bytes());
        mac.update(&micro_batch.to_le_bytes());
        let digest = mac.finalize().into_bytes();
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        u128::from_le_bytes(first)
    }

    /// Whether `token` is the token of (`epoch`, `micro_batch`). Compares without an early exit
    /// (the difference is folded into one value first).
    pub fn admits(&self, epoch: u64, micro_batch: u32, token: u128) -> bool {
        let difference = self.token(epoch, micro_batch) ^ token;
        let folded = (difference >> 64) as u64 | difference as u64;
        folded == 0
    }
}

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobKey(<{} bytes>)", Self::LEN)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn key(byte: u8) -> JobKey {
        JobKey::from_bytes([byte; JobKey::LEN])
    }

    #[test]
    fn tokens_are_stable_for_the_same_inputs() {
        let k = key(1);
        assert_eq!(k.token(5, 9), k.token(5, 9));
        assert_eq!(
            k.token(5, 9),
            key(1).token(5, 9),
            "a copy of the key agrees"
        );
        assert!(k.admits(5, 9, k.token(5, 9)));
    }

    #[test]
    fn tokens_are_distinct_per_epoch_micro_batch_and_key() {
        let k = key(1);
        let mut seen = HashSet::new();
        for epoch in [0u64, 1, 2, 1 << 32, u64::MAX] {
            for micro_batch in [0u32, 1, 2, 255, 256, u32::MAX] {
                assert!(
                    seen.insert(k.token(epoch, micro_batch)),
                    "token of ({epoch}, {micro_batch}) repeats"
                );
            }
        }
        assert_ne!(k.token(0, 0), key(2).token(0, 0), "another key");
        // Epoch and micro-batch are not interchangeable (fixed-width fields).
        assert_ne!(k.token(1, 0), k.token(0, 1));
    }

    #[test]
    fn wrong_tokens_are_not_admitted() {
        let k = key(3);
        let right = k.token(4, 2);
        for wrong in [
            0,
            right ^ 1,
            right ^ (1 << 127),
            k.token(4, 3),
            k.token(5, 2),
        ] {
            assert!(!k.admits(4, 2, wrong), "{wrong:#x}");
        }
    }

    #[test]
    fn debug_prints_no_key_byte() {
        let shown = format!("{:?}", key(0xab));
        assert!(!shown.to_lowercase().contains("ab"), "{shown}");
        assert!(!shown.contains("171"), "{shown}");
    }
}
