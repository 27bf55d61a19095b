//! The `sft` example's config file for its tests (`#[path]`-included): one small model that a
//! debug-profile build trains in seconds.

/// An `sft.toml`: `schedule` (its top-level keys), then the `[model]` table of a one-layer model
/// over byte tokens (259 ids), `max_seq_len` tokens long.
pub fn sft_toml(schedule: &str, max_seq_len: u32) -> String {
    format!(
        "{schedule}
[model]
vocab_size = 259
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
max_seq_len = {max_seq_len}
rope_theta = 10000.0
rms_eps = 1e-5
init_std = 0.05
seed = 3
"
    )
}
