//! The kernels on this CPU: every source compiled as C++ by the host's compiler with
//! `cases/cuda_on_cpu.h` (one warp, its lanes as fibers that meet at every shuffle), then `cases`'
//! checks against the references, as `device.rs` runs them on a GPU. So a kernel written where no
//! GPU is has its arithmetic, indexing and every written element checked here, in CI; what only a
//! GPU shows (its memory model, timing) stays with `device.rs`.
//!
//! The compiler is `$CXX`, else `c++`, else `g++`. Without one each check says it was skipped,
//! unless `ODC_REQUIRE_EMULATION=1` (CI), where that fails.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, LazyLock, Mutex};

use cases::{Arg, Backend};
use odc_kernels::Source;
use rand::rngs::StdRng;

mod cases;

/// One source compiled for the CPU and loaded.
struct Compiled {
    library: libloading::Library,
    name: &'static str,
}

/// Host memory a kernel reads and writes through its address (8-byte aligned).
struct HostBuffer {
    words: UnsafeCell<Vec<u64>>,
    bytes: usize,
}

/// The CPU, with its C++ compiler.
struct Cpu {
    compiler: String,
}

/// Each source compiled once per test process (the tests run on several threads; a library's
/// emulation state is its own, and [`LAUNCH`] runs one launch at a time).
static COMPILED: LazyLock<Mutex<HashMap<&'static str, Arc<Compiled>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The kernels' entry points of `code`: each `__global__ void NAME(PARAMS)` with its parameters'
/// types.
fn entry_points(code: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("__global__ void ") {
        let rest = &code[at + "__global__ void ".len()..];
        let open = rest.find('(').expect("a kernel's parameters");
        let close = rest.find(')').expect("a kernel's parameters end");
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .map(|param| {
                let param = param.trim();
                let cut = param
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .expect("a parameter's type and name");
                param[..=cut].trim().to_string()
            })
            .collect();
        found.push((name, params));
    }
    found
}

/// `code` with, for every kernel, `odc_emu_call_NAME(const unsigned long long* a)`: the kernel
/// called with its parameters from `a` (addresses and integers as they are, a `float` from the low
/// 32 bits).
fn with_callers(code: &str) -> String {
    let mut out = String::from(include_str!("cases/cuda_on_cpu.h"));
    out.push_str(code);
    for (name, params) in entry_points(code) {
        let args: Vec<String> = params
            .iter()
            .enumerate()
            .map(|(i, ty)| match ty.as_str() {
                "float" => format!("odc_emu_f32(a[{i}])"),
                t if t.contains('*') => format!("({t})(uintptr_t)a[{i}]"),
                t => format!("({t})a[{i}]"),
            })
            .collect();
        out.push_str(&format!(
            "\nextern \"C\" void odc_emu_call_{name}(const unsigned long long* a) {{ {name}({}); }}\n",
            args.join(", ")
        ));
    }
    out
}

impl Cpu {
    fn compile(&self, source: Source) -> Arc<Compiled> {
        let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = compiled.get(source.name) {
            return done.clone();
        }
        let dir: PathBuf = std::env::temp_dir().join(format!(
            "odc-kernels-emulated-{}-{}",
            std::process::id(),
            source.name.trim_end_matches(".cu")
        ));
        std::fs::create_dir_all(&dir).expect("a directory for the compiled kernels");
        let (cpp, lib) = (dir.join("kernels.cpp"), dir.join("kernels.so"));
        std::fs::write(&cpp, with_callers(source.code)).expect("writing the C++ source");
        let output = Command::new(&self.compiler)
            .args(["-std=c++17", "-O2", "-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&cpp)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.compiler));
        assert!(
            output.status.success(),
            "{} does not compile as C++ ({}):\n{}",
            source.name,
            cpp.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        // SAFETY: the library is the kernels and the emulation above: no initialisers beyond
        // zeroed statics and one vector.
        let library = unsafe { libloading::Library::new(&lib) }.expect("loading the kernels");
        let _ = std::fs::remove_dir_all(&dir);
        let done = Arc::new(Compiled {
            library,
            name: source.name,
        });
        compiled.insert(source.name, done.clone());
        done
    }
}

type Caller = unsafe extern "C" fn(*const u64);
type Launcher = unsafe extern "C" fn(Caller, *const u64, u32, i32) -> i32;

/// Threads per block, as odc's launches make them (`odc_transport::cuda` and the model's).
const BLOCK: u32 = 256;

/// The emulation runs one warp at a time on static state: one launch at a time per process.
static LAUNCH: Mutex<()> = Mutex::new(());

impl Backend for Cpu {
    type Buffer = HostBuffer;
    type Module = Arc<Compiled>;

    fn module(&self, source: Source) -> Arc<Compiled> {
        self.compile(source)
    }

    fn upload_bytes(&self, bytes: &[u8]) -> HostBuffer {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (word, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut le = [0u8; 8];
            le[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_le_bytes(le);
        }
        HostBuffer {
            words: UnsafeCell::new(words),
            bytes: bytes.len(),
        }
    }

    fn download_bytes(&self, buffer: &HostBuffer) -> Vec<u8> {
        // SAFETY: no launch runs (launches end before they return), so nothing writes.
        let words = unsafe { &*buffer.words.get() };
        let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.truncate(buffer.bytes);
        bytes
    }

    unsafe fn launch(
        &self,
        module: &Arc<Compiled>,
        function: &str,
        n: usize,
        args: &[Arg<'_, HostBuffer>],
    ) -> Result<(), String> {
        let words: Vec<u64> = args
            .iter()
            .map(|arg| match *arg {
                // SAFETY: the buffer outlives the launch; the kernel reaches its elements only
                // through this address while the launch runs.
                Arg::Buffer(buffer) => unsafe { (*buffer.words.get()).as_mut_ptr() as u64 },
                Arg::U64(value) => value,
                Arg::F32(value) => u64::from(value.to_bits()),
            })
            .collect();
        let _ = n; // The kernel's own `n` parameter bounds its grid-stride loop.
        let name = format!("odc_emu_call_{function}");
        // SAFETY: both symbols are defined by `with_callers` and the emulation header with these
        // signatures; the caller's contract (`Backend::launch`) makes `words` the kernel's
        // parameters.
        unsafe {
            let caller = *module
                .library
                .get::<Caller>(name.as_bytes())
                .map_err(|e| format!("{}: no {function}: {e}", module.name))?;
            let launcher = *module
                .library
                .get::<Launcher>(b"odc_emu_launch")
                .map_err(|e| format!("{}: {e}", module.name))?;
            let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
            // Twice, from the same inputs: threads resumed in ascending, then descending order.
            // A kernel whose result depends on that order reads what another thread writes
            // without a barrier between.
            let buffers: Vec<&HostBuffer> = args
                .iter()
                .filter_map(|arg| match *arg {
                    Arg::Buffer(buffer) => Some(buffer),
                    Arg::U64(_) | Arg::F32(_) => None,
                })
                .collect();
            let inputs: Vec<Vec<u64>> = buffers.iter().map(|b| (*b.words.get()).clone()).collect();
            let parted = |order: &str| {
                format!(
                    "{function} ({order}): threads wait for one another forever (a warp's lanes \
                     parted at a shuffle, or a barrier some thread never reached)"
                )
            };
            if launcher(caller, words.as_ptr(), BLOCK, 0) != 0 {
                return Err(parted("ascending"));
            }
            let ascending: Vec<Vec<u64>> =
                buffers.iter().map(|b| (*b.words.get()).clone()).collect();
            for (buffer, input) in buffers.iter().zip(&inputs) {
                (*buffer.words.get()).copy_from_slice(input);
            }
            if launcher(caller, words.as_ptr(), BLOCK, 1) != 0 {
                return Err(parted("descending"));
            }
            for (index, (buffer, want)) in buffers.iter().zip(&ascending).enumerate() {
                if *buffer.words.get() != *want {
                    return Err(format!(
                        "{function}: buffer {index} differs when the threads run in another \
                         order (a shared-memory read without a barrier after its write?)"
                    ));
                }
            }
            Ok(())
        }
    }
}

/// The host's C++ compiler, if there is one.
fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++".to_string(), "g++".to_string()]);
    for candidate in candidates {
        let ok = Command::new(&candidate)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(candidate);
        }
    }
    None
}

/// The CPU and a seeded generator, or `None` (said) without a C++ compiler.
fn cpu(test: &str) -> Option<(Cpu, StdRng)> {
    let Some(compiler) = compiler() else {
        assert!(
            std::env::var_os("ODC_REQUIRE_EMULATION").is_none(),
            "`{test}`: no C++ compiler ($CXX, c++, g++) and ODC_REQUIRE_EMULATION is set"
        );
        eprintln!(
            "skipped `{test}`: no C++ compiler ($CXX, c++, g++) to run the kernels on the CPU"
        );
        return None;
    };
    Some((Cpu { compiler }, cases::seeded(test)))
}

every_case!(cpu);

#[test]
fn every_kernels_parameters_are_read_from_its_source() {
    let code = "extern \"C\" __global__ void odc_x_f32(float* out, const unsigned short* q,\n    unsigned long long n, float scale) {}";
    assert_eq!(
        entry_points(code),
        vec![(
            "odc_x_f32".to_string(),
            vec![
                "float*".to_string(),
                "const unsigned short*".to_string(),
                "unsigned long long".to_string(),
                "float".to_string(),
            ]
        )]
    );
}

/// A warp whose lanes do not all reach a shuffle: undefined on a GPU, reported here; the same
/// kernel with every lane there sums the warp.
#[test]
fn a_warp_whose_lanes_part_at_a_shuffle_is_reported() {
    const SHUFFLES: Source = Source {
        name: "shuffles.cu",
        code: concat!(
            include_str!("../src/common.cuh"),
            "extern \"C\" __global__ void odc_test_sum(float* out, unsigned long long skip) {\n",
            "    unsigned int lane = threadIdx.x;\n",
            "    float v = (float)(lane & 31u);\n",
            "    if (lane != skip) v = odc_warp_sum(v);\n",
            "    out[lane] = v;\n",
            "}\n"
        ),
        functions: &["odc_test_sum"],
    };
    let Some((cpu, _)) = cpu("a_warp_whose_lanes_part_at_a_shuffle_is_reported") else {
        return;
    };
    let module = cpu.module(SHUFFLES);
    let out = cpu.poisoned(odc_transport::Dtype::F32, BLOCK as usize);
    let run = |skip: u64| {
        // SAFETY: `odc_test_sum(float* out, unsigned long long skip)`, `out` of a block's floats.
        unsafe {
            cpu.launch(
                &module,
                "odc_test_sum",
                BLOCK as usize,
                &[Arg::buffer(&out), Arg::u64(skip)],
            )
        }
    };
    run(u64::from(BLOCK)).expect("every lane at the shuffle");
    assert_eq!(
        cpu.download(odc_transport::Dtype::F32, &out),
        vec![496.0; BLOCK as usize]
    );
    let parted = run(3).expect_err("lane 3 skips the shuffle");
    assert!(parted.contains("parted at a shuffle"), "{parted}");
}

/// A block that reads shared memory another thread wrote without a barrier between: its result
/// depends on the order the threads run, which is reported; with the barrier it is not. (Shared
/// memory keeps the last launch's values here: the run without the barrier writes others, so
/// the ascending order reads stale cells.)
#[test]
fn a_shared_memory_race_is_reported() {
    const RACE: Source = Source {
        name: "race.cu",
        code: concat!(
            include_str!("../src/common.cuh"),
            "extern \"C\" __global__ void odc_test_neighbour(float* out, unsigned long long sync) {\n",
            "    __shared__ float cell[1024];\n",
            "    unsigned int i = threadIdx.x;\n",
            "    cell[i] = (float)i + (sync ? 1000.0f : 0.0f);\n",
            "    if (sync) __syncthreads();\n",
            "    out[i] = cell[(i + 1) % blockDim.x];\n",
            "}\n"
        ),
        functions: &["odc_test_neighbour"],
    };
    let Some((cpu, _)) = cpu("a_shared_memory_race_is_reported") else {
        return;
    };
    let module = cpu.module(RACE);
    let out = cpu.poisoned(odc_transport::Dtype::F32, BLOCK as usize);
    let run = |sync: u64| {
        // SAFETY: `odc_test_neighbour(float* out, unsigned long long sync)`, `out` of a block's
        // floats.
        unsafe {
            cpu.launch(
                &module,
                "odc_test_neighbour",
                BLOCK as usize,
                &[Arg::buffer(&out), Arg::u64(sync)],
            )
        }
    };
    run(1).expect("with the barrier");
    let want: Vec<f32> = (0..BLOCK)
        .map(|i| ((i + 1) % BLOCK) as f32 + 1000.0)
        .collect();
    assert_eq!(cpu.download(odc_transport::Dtype::F32, &out), want);
    let raced = run(0).expect_err("without the barrier");
    assert!(raced.contains("another order"), "{raced}");
}
