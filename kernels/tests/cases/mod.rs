//! The kernels' checks, run by two backends: `device.rs` on a GPU (feature `nvrtc`) and
//! `emulated.rs` on this CPU (the same CUDA C compiled as C++, each warp's lanes run as fibers).
//!
//! Each check runs a kernel in fp32 and bf16 on fresh random inputs (the seed is printed) into
//! outputs filled with NaN bits first (an element a kernel does not write stays NaN and fails),
//! over shapes whose rows are no multiple of a warp, and compares with
//! `odc_kernels::reference`: `‖Δ‖ / ‖ref‖ ≤ 1e-5` in fp32 and `≤ 1e-2` in bf16 (inputs rounded to
//! bf16 first, so the reference sees what the kernel sees).

pub use odc_kernels::launch::Arg;
use odc_kernels::launch::Launcher;
use odc_kernels::{reference, Source, ACCUMULATE, ATTENTION, FLASH, LOSS, NORM, ROTARY, SWIGLU};
use odc_transport::{codec, Dtype};
use rand::rngs::StdRng;
use rand::Rng;

/// Where the checks run: any [`Launcher`] (the emulation on this CPU, a GPU), its failures
/// panicking with their text (a check's failure is the test's).
pub trait Backend {
    type Buffer;
    type Module;

    fn module(&self, source: Source) -> Self::Module;
    fn upload_bytes(&self, bytes: &[u8]) -> Self::Buffer;
    fn download_bytes(&self, buffer: &Self::Buffer) -> Vec<u8>;
    /// Run `function` of `module` over `n` work items.
    ///
    /// # Safety
    /// `args` are `function`'s parameters in order, each buffer holding every element the kernel
    /// indexes for `n`.
    unsafe fn launch(
        &self,
        module: &Self::Module,
        function: &str,
        n: usize,
        args: &[Arg<'_, Self::Buffer>],
    ) -> Result<(), String>;

    /// A buffer holding `values` in `dtype`.
    fn upload(&self, dtype: Dtype, values: &[f32]) -> Self::Buffer {
        self.upload_bytes(&codec::encode(dtype, values))
    }

    /// A buffer of `n` elements of `dtype`, every bit set (NaN in fp32 and bf16).
    fn poisoned(&self, dtype: Dtype, n: usize) -> Self::Buffer {
        self.upload_bytes(&vec![0xffu8; n * dtype.size()])
    }

    fn download(&self, dtype: Dtype, buffer: &Self::Buffer) -> Vec<f32> {
        codec::decode(dtype, &self.download_bytes(buffer)).expect("decode")
    }
}

impl<L: Launcher> Backend for L {
    type Buffer = L::Buffer;
    type Module = L::Module;

    fn module(&self, source: Source) -> L::Module {
        Launcher::module(self, &source).unwrap_or_else(|e| panic!("{}: {e}", source.name))
    }

    fn upload_bytes(&self, bytes: &[u8]) -> L::Buffer {
        Launcher::upload(self, bytes).unwrap_or_else(|e| panic!("upload: {e}"))
    }

    fn download_bytes(&self, buffer: &L::Buffer) -> Vec<u8> {
        Launcher::download(self, buffer).unwrap_or_else(|e| panic!("download: {e}"))
    }

    unsafe fn launch(
        &self,
        module: &L::Module,
        function: &str,
        n: usize,
        args: &[Arg<'_, L::Buffer>],
    ) -> Result<(), String> {
        // SAFETY: the caller's contract (`Backend::launch`).
        unsafe { Launcher::launch(self, module, function, n, args) }.map_err(|e| e.to_string())
    }
}

/// A `#[test]` per check, each calling `$setup(name)` for a backend and a seeded generator (or
/// `None`, said, where the backend cannot run) and then the check.
#[macro_export]
macro_rules! every_case {
    ($setup:ident) => {
        $crate::every_case!(
            $setup:
            rms_norm_forward_and_backward_match_the_reference,
            swiglu_forward_and_backward_match_the_reference,
            rotary_forward_and_backward_match_the_reference,
            flash_attention_forward_and_backward_match_the_reference,
            attention_forward_and_backward_match_the_reference,
            the_residual_add_fused_with_rms_norm_matches_the_reference,
            cross_entropy_with_its_gradient_matches_the_reference_also_in_place,
            the_logit_gradient_of_a_block_of_classes_matches_the_reference,
            decoding_attention_matches_the_reference,
            the_accumulates_are_the_host_codecs_bit_for_bit,
            the_bf16_encode_is_the_host_codecs_bit_for_bit,
        );
    };
    ($setup:ident: $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Some((backend, rng)) = $setup(stringify!($name)) {
                    cases::$name(&backend, rng);
                }
            }
        )*
    };
}

/// A generator seeded from the clock, its seed printed for `test`.
pub fn seeded(test: &str) -> StdRng {
    use rand::SeedableRng;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn random(rng: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// `values` as `dtype` would hold them (bf16: rounded as the host codec rounds).
fn as_dtype(dtype: Dtype, values: &[f32]) -> Vec<f32> {
    codec::decode(dtype, &codec::encode(dtype, values)).expect("decode")
}

/// `‖got − want‖ / ‖want‖`; a NaN (an unwritten, poisoned element) fails.
fn relative_error(what: &str, got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (not written?)", got[i]);
    }
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (f64::from(g) - w).powi(2);
        norm += w * w;
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

/// Each `(name, got, want)` within the dtype's bound (1e-5 in fp32, 1e-2 in bf16), printed.
fn assert_close(what: &str, dtype: Dtype, outputs: &[(&str, Vec<f32>, Vec<f64>)]) {
    let bound = match dtype {
        Dtype::F32 => 1e-5,
        Dtype::Bf16 => 1e-2,
    };
    let errors: Vec<(&str, f64)> = outputs
        .iter()
        .map(|(name, got, want)| (*name, relative_error(&format!("{what} {name}"), got, want)))
        .collect();
    println!("{what}: relative errors {errors:?}");
    for (name, e) in &errors {
        assert!(*e <= bound, "{what} {name}: {e:e} over {bound:e}");
    }
}

fn suffix(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F32 => "f32",
        Dtype::Bf16 => "bf16",
    }
}

pub fn rms_norm_forward_and_backward_match_the_reference<B: Backend>(device: &B, mut rng: StdRng) {
    let norm = device.module(NORM);
    let eps = 1e-6f32;
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for (rows, cols) in [(1, 33), (37, 576), (130, 896), (5, 4096)] {
            let n = rows * cols;
            let x = as_dtype(dtype, &random(&mut rng, n, 2.0));
            let w = random(&mut rng, cols, 1.5);
            let g = as_dtype(dtype, &random(&mut rng, n, 1.0));
            let (xb, wb, gb) = (
                device.upload(dtype, &x),
                device.upload(Dtype::F32, &w),
                device.upload(dtype, &g),
            );
            let out = device.poisoned(dtype, n);
            let dx = device.poisoned(dtype, n);
            let part = device.poisoned(Dtype::F32, n);
            let dw = device.poisoned(Dtype::F32, cols);
            let shape = [
                Arg::u64(rows as u64),
                Arg::u64(cols as u64),
                Arg::f32(eps),
                Arg::u64((rows * 32) as u64),
            ];
            let (rows64, cols64) = (rows as u64, cols as u64);
            // SAFETY: each kernel's parameters as norm.cu declares them; every buffer holds the
            // elements the kernel indexes (rows × cols, cols).
            unsafe {
                let fwd = format!("odc_rms_norm_fwd_{}", suffix(dtype));
                let args = [Arg::buffer(&out), Arg::buffer(&xb), Arg::buffer(&wb)];
                let args: Vec<_> = args.into_iter().chain(shape).collect();
                device
                    .launch(&norm, &fwd, rows * 32, &args)
                    .expect("forward");
                let bwd = format!("odc_rms_norm_bwd_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&dx),
                    Arg::buffer(&part),
                    Arg::buffer(&xb),
                    Arg::buffer(&wb),
                    Arg::buffer(&gb),
                ];
                let args: Vec<_> = args.into_iter().chain(shape).collect();
                device
                    .launch(&norm, &bwd, rows * 32, &args)
                    .expect("backward");
                let args = [
                    Arg::buffer(&dw),
                    Arg::buffer(&part),
                    Arg::u64(rows64),
                    Arg::u64(cols64),
                ];
                device
                    .launch(&norm, "odc_column_sum_f32", cols, &args)
                    .expect("column sum");
            }
            let want = reference::rms_norm(&x, &w, cols, f64::from(eps));
            let (want_dx, want_dw) = reference::rms_norm_backward(&x, &w, &g, cols, f64::from(eps));
            let what = format!("rms norm {dtype:?} {rows}x{cols}");
            let got = |buffer, of| device.download(of, buffer);
            assert_close(
                &what,
                dtype,
                &[
                    ("out", got(&out, dtype), want),
                    ("dx", got(&dx, dtype), want_dx),
                    ("dw", got(&dw, Dtype::F32), want_dw),
                ],
            );
        }
    }
}

pub fn swiglu_forward_and_backward_match_the_reference<B: Backend>(device: &B, mut rng: StdRng) {
    let swiglu = device.module(SWIGLU);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for n in [1, 1000, 65_537, 1 << 20] {
            let a = as_dtype(dtype, &random(&mut rng, n, 6.0));
            let b = as_dtype(dtype, &random(&mut rng, n, 2.0));
            let g = as_dtype(dtype, &random(&mut rng, n, 1.0));
            let (ab, bb, gb) = (
                device.upload(dtype, &a),
                device.upload(dtype, &b),
                device.upload(dtype, &g),
            );
            let (out, da, db) = (
                device.poisoned(dtype, n),
                device.poisoned(dtype, n),
                device.poisoned(dtype, n),
            );
            // SAFETY: the parameters as swiglu.cu declares them; every buffer holds n elements.
            unsafe {
                let fwd = format!("odc_swiglu_fwd_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&out),
                    Arg::buffer(&ab),
                    Arg::buffer(&bb),
                    Arg::u64(n as u64),
                ];
                device.launch(&swiglu, &fwd, n, &args).expect("forward");
                let bwd = format!("odc_swiglu_bwd_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&da),
                    Arg::buffer(&db),
                    Arg::buffer(&ab),
                    Arg::buffer(&bb),
                    Arg::buffer(&gb),
                    Arg::u64(n as u64),
                ];
                device.launch(&swiglu, &bwd, n, &args).expect("backward");
            }
            let want = reference::swiglu(&a, &b);
            let (want_da, want_db) = reference::swiglu_backward(&a, &b, &g);
            let what = format!("swiglu {dtype:?} n={n}");
            let got = |buffer, of| device.download(of, buffer);
            assert_close(
                &what,
                dtype,
                &[
                    ("out", got(&out, dtype), want),
                    ("da", got(&da, dtype), want_da),
                    ("db", got(&db, dtype), want_db),
                ],
            );
        }
    }
}

pub fn rotary_forward_and_backward_match_the_reference<B: Backend>(device: &B, mut rng: StdRng) {
    let rotary = device.module(ROTARY);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        // Heads first (group 1) and tokens first (group = the heads).
        let shapes = [(1, 3, 64), (14, 37, 64), (9, 129, 96), (2, 300, 128)];
        for ((heads, positions, dim), group) in shapes.into_iter().flat_map(|s| [(s, 1), (s, s.0)])
        {
            let rows = heads * positions;
            let n = rows * dim;
            let x = as_dtype(dtype, &random(&mut rng, n, 2.0));
            let angles: Vec<f32> = (0..positions * dim / 2)
                .map(|i| {
                    let (p, j) = (i / (dim / 2), i % (dim / 2));
                    p as f32 * 10_000f32.powf(-2.0 * j as f32 / dim as f32)
                })
                .collect();
            let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let (xb, cb, sb) = (
                device.upload(dtype, &x),
                device.upload(Dtype::F32, &cos),
                device.upload(Dtype::F32, &sin),
            );
            for sign in [1.0f32, -1.0] {
                let out = device.poisoned(dtype, n);
                // SAFETY: the parameters as rotary.cu declares them; x and out hold rows × dim
                // elements, the tables positions × dim / 2.
                unsafe {
                    let function = format!("odc_rope_{}", suffix(dtype));
                    let args = [
                        Arg::buffer(&out),
                        Arg::buffer(&xb),
                        Arg::buffer(&cb),
                        Arg::buffer(&sb),
                        Arg::u64(positions as u64),
                        Arg::u64(group as u64),
                        Arg::u64(dim as u64),
                        Arg::f32(sign),
                        Arg::u64((n / 2) as u64),
                    ];
                    device
                        .launch(&rotary, &function, n / 2, &args)
                        .expect("rope");
                }
                let want =
                    reference::rope(&x, &cos, &sin, (positions, group), dim, f64::from(sign));
                let what =
                    format!("rope {dtype:?} {heads}x{positions}x{dim} group {group} sign {sign}");
                assert_close(&what, dtype, &[("out", device.download(dtype, &out), want)]);
            }
        }
    }
}

pub fn attention_forward_and_backward_match_the_reference<B: Backend>(device: &B, mut rng: StdRng) {
    // Packings with lengths that are no multiple of anything, GQA ratios, every head_dim; then
    // queries and keys of their own lengths: causal with more keys than queries and fewer (its
    // first queries see none), and not causal with a sample that has no keys.
    let cases = [
        Shape::packed(&[1, 37, 130, 7], 14, 2, 64),
        Shape::packed(&[200, 3], 9, 3, 96),
        Shape::packed(&[0, 64, 65], 8, 2, 128),
        Shape::cross(&[4, 37, 50], &[9, 20, 70], true, 6, 2, 64),
        Shape::cross(&[33, 5], &[40, 0], false, 4, 4, 96),
    ];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for case in cases {
            check_attention(device, &mut rng, AttentionKernel::Plain, dtype, case);
        }
    }
}

pub fn the_residual_add_fused_with_rms_norm_matches_the_reference<B: Backend>(
    device: &B,
    mut rng: StdRng,
) {
    let norm = device.module(NORM);
    let eps = 1e-6f32;
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for (rows, cols) in [(1, 33), (37, 576), (130, 896)] {
            let n = rows * cols;
            let a = as_dtype(dtype, &random(&mut rng, n, 2.0));
            let b = as_dtype(dtype, &random(&mut rng, n, 2.0));
            let w = random(&mut rng, cols, 1.5);
            let g = as_dtype(dtype, &random(&mut rng, n, 1.0));
            let g_res = as_dtype(dtype, &random(&mut rng, n, 1.0));
            let (ab, bb, wb, gb, rb) = (
                device.upload(dtype, &a),
                device.upload(dtype, &b),
                device.upload(Dtype::F32, &w),
                device.upload(dtype, &g),
                device.upload(dtype, &g_res),
            );
            let (sum, out, ds) = (
                device.poisoned(dtype, n),
                device.poisoned(dtype, n),
                device.poisoned(dtype, n),
            );
            let part = device.poisoned(Dtype::F32, n);
            let dw = device.poisoned(Dtype::F32, cols);
            let shape = [
                Arg::u64(rows as u64),
                Arg::u64(cols as u64),
                Arg::f32(eps),
                Arg::u64((rows * 32) as u64),
            ];
            // SAFETY: each kernel's parameters as norm.cu declares them; every buffer holds the
            // elements the kernel indexes (rows × cols, cols).
            unsafe {
                let fwd = format!("odc_add_rms_norm_fwd_{}", suffix(dtype));
                let args = [&sum, &out, &ab, &bb, &wb].map(Arg::buffer);
                let args: Vec<_> = args.into_iter().chain(shape).collect();
                device
                    .launch(&norm, &fwd, rows * 32, &args)
                    .expect("forward");
                // The backward reads the stored sum, as a model's would.
                let bwd = format!("odc_add_rms_norm_bwd_{}", suffix(dtype));
                let args = [&ds, &part, &sum, &wb, &gb, &rb].map(Arg::buffer);
                let args: Vec<_> = args.into_iter().chain(shape).collect();
                device
                    .launch(&norm, &bwd, rows * 32, &args)
                    .expect("backward");
                let args = [
                    Arg::buffer(&dw),
                    Arg::buffer(&part),
                    Arg::u64(rows as u64),
                    Arg::u64(cols as u64),
                ];
                device
                    .launch(&norm, "odc_column_sum_f32", cols, &args)
                    .expect("column sum");
            }
            let (want_sum, want_out) = reference::add_rms_norm(&a, &b, &w, cols, f64::from(eps));
            let stored = device.download(dtype, &sum);
            let (want_ds, want_dw) =
                reference::add_rms_norm_backward(&stored, &w, &g, &g_res, cols, f64::from(eps));
            let what = format!("add + rms norm {dtype:?} {rows}x{cols}");
            assert_close(
                &what,
                dtype,
                &[
                    ("sum", stored, want_sum),
                    ("out", device.download(dtype, &out), want_out),
                    ("ds", device.download(dtype, &ds), want_ds),
                    ("dw", device.download(Dtype::F32, &dw), want_dw),
                ],
            );
        }
    }
}

pub fn cross_entropy_with_its_gradient_matches_the_reference_also_in_place<B: Backend>(
    device: &B,
    mut rng: StdRng,
) {
    let loss_module = device.module(LOSS);
    // Vocabularies of SmolLM2 (49,152) and Qwen2.5 (151,936), and sizes no multiple of a warp.
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for (rows, vocab, in_place) in [(1, 33, false), (37, 1000, true), (9, 49_152, false)]
            .into_iter()
            .chain([(3, 151_936, true)])
        {
            let logits = as_dtype(dtype, &random(&mut rng, rows * vocab, 8.0));
            // Every fifth row ignored (−100), the others a random class; weights as a loss
            // over tokens gives them.
            let targets: Vec<i64> = (0..rows)
                .map(|r| {
                    if r % 5 == 4 {
                        -100
                    } else {
                        rng.random_range(0..vocab as i64)
                    }
                })
                .collect();
            let weights = random(&mut rng, rows, 1.0);
            let target_bytes: Vec<u8> = targets.iter().flat_map(|t| t.to_le_bytes()).collect();
            let (xb, tb, wb) = (
                device.upload(dtype, &logits),
                device.upload_bytes(&target_bytes),
                device.upload(Dtype::F32, &weights),
            );
            let grad = if in_place {
                None
            } else {
                Some(device.poisoned(dtype, rows * vocab))
            };
            let (loss, lse) = (
                device.poisoned(Dtype::F32, rows),
                device.poisoned(Dtype::F32, rows),
            );
            let dlogits = grad.as_ref().unwrap_or(&xb);
            // SAFETY: the parameters as loss.cu declares them; logits and dlogits hold
            // rows × vocab elements (the same buffer in place, which the kernel allows),
            // targets rows i64s, weights, loss and lse rows fp32s.
            unsafe {
                let function = format!("odc_cross_entropy_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&loss),
                    Arg::buffer(&lse),
                    Arg::buffer(dlogits),
                    Arg::buffer(&xb),
                    Arg::buffer(&tb),
                    Arg::buffer(&wb),
                    Arg::u64(rows as u64),
                    Arg::u64(vocab as u64),
                    Arg::u64((rows * 32) as u64),
                ];
                device
                    .launch(&loss_module, &function, rows * 32, &args)
                    .expect("cross-entropy");
            }
            let (want_loss, want_lse, want_grad) =
                reference::cross_entropy(&logits, &targets, &weights, vocab);
            let what = format!("cross-entropy {dtype:?} {rows}x{vocab} in place {in_place}");
            assert_close(
                &what,
                dtype,
                &[
                    ("loss", device.download(Dtype::F32, &loss), want_loss),
                    ("lse", device.download(Dtype::F32, &lse), want_lse),
                    ("dlogits", device.download(dtype, dlogits), want_grad),
                ],
            );
        }
    }
}

pub fn the_logit_gradient_of_a_block_of_classes_matches_the_reference<B: Backend>(
    device: &B,
    mut rng: StdRng,
) {
    let loss_module = device.module(LOSS);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        // (rows, the block's classes, its first class, the vocabulary the targets come from)
        for (rows, cols, first, vocab) in
            [(1, 33, 0, 33), (37, 1000, 4000, 151_936), (300, 77, 5, 90)]
        {
            let logits = random(&mut rng, rows * cols, 8.0);
            let lse: Vec<f32> = (0..rows).map(|_| rng.random_range(5.0f32..15.0)).collect();
            // Some targets inside the block, some outside, some ignored.
            let targets: Vec<i64> = (0..rows)
                .map(|r| match r % 3 {
                    0 => (first + r % cols) as i64,
                    1 => rng.random_range(0..vocab as i64),
                    _ => -100,
                })
                .collect();
            let weights = random(&mut rng, rows, 1.0);
            let target_bytes: Vec<u8> = targets.iter().flat_map(|t| t.to_le_bytes()).collect();
            let (xb, lb, tb, wb) = (
                device.upload(Dtype::F32, &logits),
                device.upload(Dtype::F32, &lse),
                device.upload_bytes(&target_bytes),
                device.upload(Dtype::F32, &weights),
            );
            let dlogits = device.poisoned(dtype, rows * cols);
            let n = rows * cols;
            // SAFETY: the parameters as loss.cu declares them; logits and dlogits hold
            // rows × cols elements, lse, targets and weights rows each.
            unsafe {
                let function = format!("odc_softmax_grad_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&dlogits),
                    Arg::buffer(&xb),
                    Arg::buffer(&lb),
                    Arg::buffer(&tb),
                    Arg::buffer(&wb),
                    Arg::u64(cols as u64),
                    Arg::u64(first as u64),
                    Arg::u64(n as u64),
                ];
                device
                    .launch(&loss_module, &function, n, &args)
                    .expect("softmax gradient");
            }
            let want = reference::softmax_grad(&logits, &lse, &targets, &weights, cols, first);
            let what = format!("softmax grad {dtype:?} {rows}x{cols} from class {first}");
            assert_close(
                &what,
                dtype,
                &[("dlogits", device.download(dtype, &dlogits), want)],
            );
        }
    }
}

pub fn decoding_attention_matches_the_reference<B: Backend>(device: &B, mut rng: StdRng) {
    let attention = device.module(ATTENTION);
    // (rows, heads, kv_heads, dim, capacity, filled columns); paddings drawn per row, one row
    // with nothing to attend where the shape allows it.
    let cases = [
        (1, 2, 2, 64, 64, 1),
        (8, 14, 2, 64, 128, 97),
        (5, 9, 3, 96, 256, 200),
        (3, 8, 2, 128, 64, 64),
    ];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for (rows, heads, kv_heads, dim, capacity, len) in cases {
            let pads: Vec<usize> = (0..rows)
                .map(|r| match r {
                    0 => 0,
                    1 if len > 1 => len,
                    _ => rng.random_range(0..len),
                })
                .collect();
            let q = as_dtype(dtype, &random(&mut rng, rows * heads * dim, 1.0));
            let k = as_dtype(
                dtype,
                &random(&mut rng, rows * kv_heads * capacity * dim, 1.0),
            );
            let v = as_dtype(
                dtype,
                &random(&mut rng, rows * kv_heads * capacity * dim, 1.0),
            );
            let pad_bytes: Vec<u8> = pads
                .iter()
                .flat_map(|&p| (p as i64).to_le_bytes())
                .collect();
            let (qb, kb, vb, pb) = (
                device.upload(dtype, &q),
                device.upload(dtype, &k),
                device.upload(dtype, &v),
                device.upload_bytes(&pad_bytes),
            );
            let out = device.poisoned(dtype, rows * heads * dim);
            let scale = 1.0 / (dim as f32).sqrt();
            let n = rows * heads * 32;
            // SAFETY: the parameters as attention.cu declares them; q and out hold
            // rows × heads × dim elements, k and v rows × kv_heads × capacity × dim, pads rows.
            unsafe {
                let function = format!("odc_decode_attention_{}", suffix(dtype));
                let args = [
                    Arg::buffer(&out),
                    Arg::buffer(&qb),
                    Arg::buffer(&kb),
                    Arg::buffer(&vb),
                    Arg::buffer(&pb),
                    Arg::u64(heads as u64),
                    Arg::u64(kv_heads as u64),
                    Arg::u64(capacity as u64),
                    Arg::u64(len as u64),
                    Arg::u64(dim as u64),
                    Arg::f32(scale),
                    Arg::u64(n as u64),
                ];
                device
                    .launch(&attention, &function, n, &args)
                    .expect("decoding attention");
            }
            let want = reference::decode_attention(
                &q,
                &k,
                &v,
                &pads,
                heads,
                kv_heads,
                capacity,
                len,
                dim,
                f64::from(scale),
            );
            let what = format!(
                "decoding attention {dtype:?} {rows} rows, heads {heads}/{kv_heads}, dim {dim}, \
                 {len} of {capacity} columns, pads {pads:?}"
            );
            assert_close(&what, dtype, &[("out", device.download(dtype, &out), want)]);
        }
    }
}

/// FlashAttention-2's tiled forward and backward (bf16): tiles of 128 query rows or keys (8
/// warps) against 64 keys (forward) or 32 (backward), so these packings put sample boundaries
/// inside tiles, rows of a tile past the last token, and samples longer than a tile; every head
/// width it takes, GQA ratios; and queries and keys of their own lengths, as ring attention
/// takes them (a chunk against itself, causal; against an earlier chunk, not causal), and with
/// the ends aligned (causal, more keys than queries and fewer).
pub fn flash_attention_forward_and_backward_match_the_reference<B: Backend>(
    device: &B,
    mut rng: StdRng,
) {
    let cases = [
        Shape::packed(&[1, 37, 130, 7], 14, 2, 64),
        Shape::packed(&[200, 3], 9, 3, 96),
        Shape::packed(&[0, 64, 65], 8, 2, 128),
        Shape::packed(&[300, 1, 90], 4, 1, 64),
        Shape::cross(&[130], &[70], false, 4, 2, 64),
        Shape::cross(&[100, 29], &[300, 9], false, 2, 1, 128),
        Shape::cross(&[150, 40], &[100, 200], true, 4, 2, 96),
    ];
    for case in cases {
        check_attention(device, &mut rng, AttentionKernel::Flash, Dtype::Bf16, case);
    }
}

/// Which attention kernels a check runs: `attention.cu`'s warps, or `flash.cu`'s tiles (bf16)
/// with `attention.cu`'s `prep`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum AttentionKernel {
    Plain,
    Flash,
}

/// An attention check's samples: each one's queries and keys, causal or not, and the heads.
#[derive(Debug, Clone, Copy)]
struct Shape {
    queries: &'static [usize],
    keys: &'static [usize],
    causal: bool,
    heads: usize,
    kv_heads: usize,
    dim: usize,
}

impl Shape {
    /// Causal self-attention over samples packed as `lengths`.
    fn packed(lengths: &'static [usize], heads: usize, kv_heads: usize, dim: usize) -> Self {
        Shape::cross(lengths, lengths, true, heads, kv_heads, dim)
    }

    fn cross(
        queries: &'static [usize],
        keys: &'static [usize],
        causal: bool,
        heads: usize,
        kv_heads: usize,
        dim: usize,
    ) -> Self {
        Shape {
            queries,
            keys,
            causal,
            heads,
            kv_heads,
            dim,
        }
    }
}

/// Offsets `[0, l0, l0 + l1, ..]` of samples of `lengths`.
fn offsets(lengths: &[usize]) -> Vec<usize> {
    let mut cu = vec![0usize];
    for len in lengths {
        cu.push(cu.last().copied().unwrap_or(0) + len);
    }
    cu
}

/// The forward on random inputs laid out as `shape`, then the backward from the kernel's own
/// output and log-sum-exp (as a model runs it), against the reference; every output poisoned
/// first. A query that sees no key must get a log-sum-exp of −inf (and zeros).
fn check_attention<B: Backend>(
    device: &B,
    rng: &mut StdRng,
    kernel: AttentionKernel,
    dtype: Dtype,
    shape: Shape,
) {
    let Shape {
        heads,
        kv_heads,
        dim,
        ..
    } = shape;
    // The plain source always (its `prep`); flash's only where it runs (it needs sm_80).
    let attention = device.module(ATTENTION);
    let flash;
    let (cu_q, cu_k) = (offsets(shape.queries), offsets(shape.keys));
    let varlen = reference::Varlen {
        cu_q: &cu_q,
        cu_k: &cu_k,
        causal: shape.causal,
    };
    let tokens = *cu_q.last().unwrap_or(&0);
    let key_tokens = *cu_k.last().unwrap_or(&0);
    let q = as_dtype(dtype, &random(rng, tokens * heads * dim, 1.0));
    let k = as_dtype(dtype, &random(rng, key_tokens * kv_heads * dim, 1.0));
    let v = as_dtype(dtype, &random(rng, key_tokens * kv_heads * dim, 1.0));
    let dout = as_dtype(dtype, &random(rng, tokens * heads * dim, 1.0));
    let scale = 1.0 / (dim as f32).sqrt();
    let bytes =
        |cu: &[usize]| -> Vec<u8> { cu.iter().flat_map(|&c| (c as u64).to_le_bytes()).collect() };
    let (qb, kb, vb, gb, cqb, ckb) = (
        device.upload(dtype, &q),
        device.upload(dtype, &k),
        device.upload(dtype, &v),
        device.upload(dtype, &dout),
        device.upload_bytes(&bytes(&cu_q)),
        device.upload_bytes(&bytes(&cu_k)),
    );
    let out = device.poisoned(dtype, tokens * heads * dim);
    let lse = device.poisoned(Dtype::F32, tokens * heads);
    let delta = device.poisoned(Dtype::F32, tokens * heads);
    let dq = device.poisoned(dtype, tokens * heads * dim);
    let dk = device.poisoned(Dtype::F32, key_tokens * kv_heads * dim);
    let dv = device.poisoned(Dtype::F32, key_tokens * kv_heads * dim);
    // Work items: a warp per row (plain), a block of 256 threads per 128 rows (flash).
    let rows = tokens * heads * 32;
    let (module, prefix, queries, keys) = match kernel {
        AttentionKernel::Plain => (
            &attention,
            "odc_attention",
            rows,
            key_tokens * kv_heads * 32,
        ),
        AttentionKernel::Flash => {
            flash = device.module(FLASH);
            (
                &flash,
                "odc_flash_attention",
                tokens.div_ceil(128) * heads * 256,
                key_tokens.div_ceil(128) * kv_heads * 256,
            )
        }
    };
    let sfx = suffix(dtype);
    // SAFETY: every kernel's parameters as attention.cu and flash.cu declare them; q, out, dout
    // and dq hold tokens × heads × dim elements of the dtype, k and v key_tokens × kv_heads ×
    // dim, dk and dv key_tokens × kv_heads × dim fp32, lse and delta tokens × heads fp32, cu_q
    // and cu_k samples + 1; each launch's `n` as its source's comment says.
    unsafe {
        // What every attention kernel takes after its tensors.
        let tail = [
            Arg::buffer(&cqb),
            Arg::buffer(&ckb),
            Arg::u64(shape.queries.len() as u64),
            Arg::u64(u64::from(shape.causal)),
            Arg::u64(heads as u64),
            Arg::u64(kv_heads as u64),
            Arg::u64(dim as u64),
            Arg::f32(scale),
        ];
        let mut args = vec![
            Arg::buffer(&out),
            Arg::buffer(&lse),
            Arg::buffer(&qb),
            Arg::buffer(&kb),
            Arg::buffer(&vb),
        ];
        args.extend(tail.iter().copied());
        args.push(Arg::u64(queries as u64));
        device
            .launch(module, &format!("{prefix}_fwd_{sfx}"), queries, &args)
            .expect("attention");
        let prep = [
            Arg::buffer(&delta),
            Arg::buffer(&out),
            Arg::buffer(&gb),
            Arg::u64(dim as u64),
            Arg::u64(rows as u64),
        ];
        let function = format!("odc_attention_bwd_prep_{sfx}");
        device
            .launch(&attention, &function, rows, &prep)
            .expect("attention backward: prep");
        let mut shared = vec![
            Arg::buffer(&qb),
            Arg::buffer(&kb),
            Arg::buffer(&vb),
            Arg::buffer(&gb),
            Arg::buffer(&lse),
            Arg::buffer(&delta),
        ];
        shared.extend(tail.iter().copied());
        let mut args = vec![Arg::buffer(&dq)];
        args.extend(shared.iter().copied());
        args.push(Arg::u64(queries as u64));
        device
            .launch(module, &format!("{prefix}_bwd_dq_{sfx}"), queries, &args)
            .expect("attention backward: dq");
        let mut args = vec![Arg::buffer(&dk), Arg::buffer(&dv)];
        args.extend(shared.iter().copied());
        args.push(Arg::u64(keys as u64));
        device
            .launch(module, &format!("{prefix}_bwd_dkdv_{sfx}"), keys, &args)
            .expect("attention backward: dk, dv");
    }
    let (want, mut want_lse) =
        reference::attention(&q, &k, &v, varlen, heads, kv_heads, dim, f64::from(scale));
    let (want_dq, want_dk, want_dv) = reference::attention_backward(
        &q,
        &k,
        &v,
        &dout,
        varlen,
        heads,
        kv_heads,
        dim,
        f64::from(scale),
    );
    let what = format!("attention ({kernel:?}) {dtype:?} {shape:?}");
    // Rows that see no key: −inf on both sides (a NaN, unwritten, fails), then left out.
    let mut got_lse = device.download(Dtype::F32, &lse);
    for (i, (got, want)) in got_lse.iter_mut().zip(&mut want_lse).enumerate() {
        if *want == f64::NEG_INFINITY {
            assert!(
                *got == f32::NEG_INFINITY,
                "{what}: lse {i} is {got}, not −inf"
            );
            (*got, *want) = (0.0, 0.0);
        }
    }
    assert_close(
        &what,
        dtype,
        &[
            ("out", device.download(dtype, &out), want),
            ("lse", got_lse, want_lse),
            ("dq", device.download(dtype, &dq), want_dq),
            ("dk", device.download(Dtype::F32, &dk), want_dk),
            ("dv", device.download(Dtype::F32, &dv), want_dv),
        ],
    );
}

/// Elements of the accumulate checks: several grid-stride passes of a block and no round number.
const ACCUMULATE_LEN: usize = 3 * 256 + 29;

/// `ACCUMULATE_LEN` values from bit patterns of every kind: normal, subnormal, ±0, ±∞, NaNs
/// (quiet and signalling), exact bf16 ties (odd and even), from a splitmix64 sequence.
fn every_kind_of_value(seed: u64) -> Vec<f32> {
    let special = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
        f32::MIN_POSITIVE,
    ];
    let mut z = seed;
    (0..ACCUMULATE_LEN)
        .map(|i| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            match i % 4 {
                0 => special[(x as usize) % special.len()],
                1 => f32::from_bits(x as u32),
                _ => (x as u32 as f32 / u32::MAX as f32 - 0.5) * 8.0,
            }
        })
        .collect()
}

/// The transport's accumulates ([`ACCUMULATE`]: fp32 and bf16 into fp32) equal the host codec's
/// `add_f32_into` (of the decoded bf16) bit for bit, over values of every kind.
pub fn the_accumulates_are_the_host_codecs_bit_for_bit<B: Backend>(device: &B, _rng: StdRng) {
    let module = device.module(ACCUMULATE);
    let acc = every_kind_of_value(1);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let src = codec::encode(dtype, &every_kind_of_value(2));
        let mut want = acc.clone();
        let widened = codec::encode_f32(&codec::decode(dtype, &src).expect("decode"));
        codec::add_f32_into(&widened, &mut want).expect("the host's add");
        let out = device.upload_bytes(&codec::encode_f32(&acc));
        let input = device.upload_bytes(&src);
        let function = format!("odc_add_{}", suffix(dtype));
        let n = ACCUMULATE_LEN as u64;
        // SAFETY: `odc_add_*(float* acc, const T* src, unsigned long long n)`; both hold `n`
        // elements.
        unsafe {
            let args = [Arg::buffer(&out), Arg::buffer(&input), Arg::u64(n)];
            device.launch(&module, &function, ACCUMULATE_LEN, &args)
        }
        .unwrap_or_else(|e| panic!("{function}: {e}"));
        assert_eq!(
            device.download_bytes(&out),
            codec::encode_f32(&want).to_vec(),
            "{function}: not the host's sums bit for bit"
        );
    }
}

/// The transport's fp32 → bf16 encode equals the host codec's bit for bit, ties and NaNs
/// included.
pub fn the_bf16_encode_is_the_host_codecs_bit_for_bit<B: Backend>(device: &B, _rng: StdRng) {
    let module = device.module(ACCUMULATE);
    let src = every_kind_of_value(3);
    let out = device.upload_bytes(&vec![0xa5u8; ACCUMULATE_LEN * 2]);
    let input = device.upload_bytes(&codec::encode_f32(&src));
    // SAFETY: `odc_encode_bf16(unsigned short* dst, const float* src, unsigned long long n)`;
    // dst holds n bf16, src n floats.
    unsafe {
        let args = [
            Arg::buffer(&out),
            Arg::buffer(&input),
            Arg::u64(ACCUMULATE_LEN as u64),
        ];
        device.launch(&module, "odc_encode_bf16", ACCUMULATE_LEN, &args)
    }
    .unwrap_or_else(|e| panic!("odc_encode_bf16: {e}"));
    let want = codec::encode(Dtype::Bf16, &src);
    let got = device.download_bytes(&out);
    if let Some(i) = (0..ACCUMULATE_LEN).find(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2])
    {
        panic!(
            "element {i} ({:#010x}) encodes to {:02x?} on the kernel, {:02x?} on the host",
            src[i].to_bits(),
            &got[2 * i..2 * i + 2],
            &want[2 * i..2 * i + 2]
        );
    }
}
