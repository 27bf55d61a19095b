//! CUDA C on the CPU (feature `emulate`), for tests where no GPU is: a kernel source compiled as
//! C++ by the host's compiler with `cuda_on_cpu.h` (what odc's kernels use of CUDA: one block of
//! [`BLOCK`] threads as fibers that meet at every shuffle, `mma.sync` and barrier; `__shared__`
//! memory), loaded, and launched over host buffers.
//!
//! - Every launch runs twice from the same inputs, the threads resumed in ascending and then
//!   descending order, and must leave the same bytes: a kernel that reads what another thread
//!   writes without a barrier between is reported. Threads that wait for one another forever (a
//!   warp's lanes parted at a collective, a barrier some thread left without reaching) are
//!   reported too.
//! - What it cannot see: the GPU's memory model beyond one block's thread orders, the device's
//!   own float functions (the host's libm is within an ulp of them), the tensor cores' own
//!   accumulation order, atomics (odc's kernels use none). Compiled without contraction of
//!   multiplies and adds (`-ffp-contract=off`), as odc compiles them with NVRTC (`--fmad=false`).
//! - The compiler is `$CXX`, else `c++`, else `g++` ([`Emulator::find`]); a source is compiled
//!   once per process.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, LazyLock, Mutex};

use crate::launch::{self, Launcher};
use crate::Source;

/// Threads per block, as odc's launches make them.
pub use crate::BLOCK;

/// The host's C++ compiler.
#[derive(Debug, Clone)]
pub struct Emulator {
    compiler: String,
}

/// One source compiled for the CPU and loaded.
pub struct Module {
    library: libloading::Library,
    name: String,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("name", &self.name).finish()
    }
}

/// Host memory a kernel reads and writes through its address (8-byte aligned).
pub struct HostBuffer {
    words: UnsafeCell<Vec<u64>>,
    bytes: usize,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl HostBuffer {
    /// A buffer holding `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
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

    /// How many bytes it holds.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Its bytes now (no launch runs while this borrows the buffer: launches return first).
    pub fn to_bytes(&self) -> Vec<u8> {
        // SAFETY: launches end before they return and hold the buffer's address only while they
        // run, so nothing writes it during this read.
        let words = unsafe { &*self.words.get() };
        let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.truncate(self.bytes);
        bytes
    }
}

/// One parameter of an emulated launch: [`launch::Arg`] over [`HostBuffer`]s.
pub type Arg<'a> = launch::Arg<'a, HostBuffer>;

/// The kernels' entry points of `code`: each `__global__ void NAME(PARAMS)` with its parameters'
/// types.
pub fn entry_points(code: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("__global__ void ") {
        let rest = &code[at + "__global__ void ".len()..];
        let (Some(open), Some(close)) = (rest.find('('), rest.find(')')) else {
            continue;
        };
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .filter_map(|param| {
                let param = param.trim();
                let cut = param.rfind(|c: char| !(c.is_alphanumeric() || c == '_'))?;
                Some(param[..=cut].trim().to_string())
            })
            .collect();
        found.push((name, params));
    }
    found
}

/// `code` after the emulation header, with, for every kernel, `odc_emu_call_NAME(const unsigned
/// long long* a)`: the kernel called with its parameters from `a` (addresses and integers as
/// they are, a `float` from the low 32 bits, a `double` from all 64).
fn with_callers(code: &str) -> String {
    let mut out = String::from(include_str!("cuda_on_cpu.h"));
    out.push_str(code);
    for (name, params) in entry_points(code) {
        let args: Vec<String> = params
            .iter()
            .enumerate()
            .map(|(i, ty)| match ty.as_str() {
                "float" => format!("odc_emu_f32(a[{i}])"),
                "double" => format!("odc_emu_f64(a[{i}])"),
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

/// A source's name and code.
type SourceKey = (String, String);

/// Each source compiled once per process, by its name and code.
static COMPILED: LazyLock<Mutex<HashMap<SourceKey, Arc<Module>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The emulation runs one block at a time on each library's static state: one launch at a time.
static LAUNCH: Mutex<()> = Mutex::new(());

type Caller = unsafe extern "C" fn(*const u64);
type LaunchFn = unsafe extern "C" fn(Caller, *const u64, u32, i32) -> i32;

impl Emulator {
    /// The host's C++ compiler (`$CXX`, `c++`, `g++`), if there is one.
    pub fn find() -> Option<Emulator> {
        let candidates = std::env::var("CXX")
            .ok()
            .into_iter()
            .chain(["c++".to_string(), "g++".to_string()]);
        for compiler in candidates {
            let ok = Command::new(&compiler)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success());
            if ok {
                return Some(Emulator { compiler });
            }
        }
        None
    }

    /// [`Emulator::find`] for test `test`: without a compiler it says the test is skipped and
    /// returns `None`, unless `ODC_REQUIRE_EMULATION` is set (CI), where it panics.
    pub fn for_test(test: &str) -> Option<Emulator> {
        let found = Emulator::find();
        if found.is_none() {
            assert!(
                std::env::var_os("ODC_REQUIRE_EMULATION").is_none(),
                "`{test}`: no C++ compiler ($CXX, c++, g++) and ODC_REQUIRE_EMULATION is set"
            );
            eprintln!(
                "skipped `{test}`: no C++ compiler ($CXX, c++, g++) to run kernels on the CPU"
            );
        }
        found
    }

    /// `code` (CUDA C with `extern "C" __global__` kernels, no header) compiled and loaded, once
    /// per process; the compiler's complaint if it does not compile.
    pub fn compile(&self, name: &str, code: &str) -> Result<Arc<Module>, String> {
        let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
        let key = (name.to_string(), code.to_string());
        if let Some(done) = compiled.get(&key) {
            return Ok(done.clone());
        }
        let dir = std::env::temp_dir().join(format!(
            "odc-kernels-emulated-{}-{}-{}",
            std::process::id(),
            compiled.len(),
            name.replace(|c: char| !c.is_alphanumeric(), "_")
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (cpp, lib) = (dir.join("kernels.cpp"), dir.join("kernels.so"));
        std::fs::write(&cpp, with_callers(code)).map_err(|e| format!("{}: {e}", cpp.display()))?;
        let output = Command::new(&self.compiler)
            .args([
                "-std=c++17",
                "-O2",
                "-ffp-contract=off",
                "-shared",
                "-fPIC",
                "-o",
            ])
            .arg(&lib)
            .arg(&cpp)
            .output()
            .map_err(|e| format!("running {}: {e}", self.compiler))?;
        if !output.status.success() {
            return Err(format!(
                "{name} does not compile as C++ ({}):\n{}",
                cpp.display(),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        // SAFETY: the library is the kernels and the emulation header: no initialisers beyond
        // zeroed statics and one vector.
        let library = unsafe { libloading::Library::new(&lib) }
            .map_err(|e| format!("loading {name}: {e}"))?;
        let _ = std::fs::remove_dir_all(&dir);
        let done = Arc::new(Module {
            library,
            name: name.to_string(),
        });
        compiled.insert(key, done.clone());
        Ok(done)
    }
}

impl Module {
    /// Run `function` with `args` as one block of [`BLOCK`] threads (its grid-stride loops cover
    /// the grid), twice (see the module docs).
    ///
    /// # Safety
    /// `args` are `function`'s parameters in order and of their types, each buffer holding every
    /// element the kernel indexes.
    pub unsafe fn launch(&self, function: &str, args: &[Arg<'_>]) -> Result<(), String> {
        let words: Vec<u64> = args
            .iter()
            .map(|arg| match *arg {
                // SAFETY: the buffer outlives the launch; the kernel reaches its elements only
                // through this address while the launch runs.
                Arg::Buffer(buffer) => unsafe { (*buffer.words.get()).as_mut_ptr() as u64 },
                Arg::U64(value) => value,
                // An `int` parameter is the low bits of its word.
                Arg::I32(value) => u64::from(value as u32),
                Arg::F32(value) => u64::from(value.to_bits()),
                Arg::F64(value) => value.to_bits(),
            })
            .collect();
        let name = format!("odc_emu_call_{function}");
        // SAFETY: both symbols are defined by `with_callers` and the emulation header with these
        // signatures; the caller's contract makes `words` the kernel's parameters.
        unsafe {
            let caller = *self
                .library
                .get::<Caller>(name.as_bytes())
                .map_err(|e| format!("{}: no {function}: {e}", self.name))?;
            let launcher = *self
                .library
                .get::<LaunchFn>(b"odc_emu_launch")
                .map_err(|e| format!("{}: {e}", self.name))?;
            let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
            let buffers: Vec<&HostBuffer> = args
                .iter()
                .filter_map(|arg| match *arg {
                    Arg::Buffer(buffer) => Some(buffer),
                    _ => None,
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

/// This CPU as a [`Launcher`]: one block of [`BLOCK`] threads a launch, whose grid-stride loops
/// cover the grid (the kernel's own `n` parameter bounds them), run twice in two thread orders.
impl Launcher for Emulator {
    type Buffer = HostBuffer;
    type Module = Arc<Module>;
    type Error = String;

    fn module(&self, source: &Source) -> Result<Arc<Module>, String> {
        self.compile(source.name, source.code)
    }

    fn upload(&self, bytes: &[u8]) -> Result<HostBuffer, String> {
        Ok(HostBuffer::from_bytes(bytes))
    }

    fn download(&self, buffer: &HostBuffer) -> Result<Vec<u8>, String> {
        Ok(buffer.to_bytes())
    }

    fn bytes(&self, buffer: &HostBuffer) -> usize {
        buffer.len()
    }

    fn blocks(&self, _module: &Arc<Module>, _n: usize) -> u32 {
        1
    }

    unsafe fn launch(
        &self,
        module: &Arc<Module>,
        function: &str,
        n: usize,
        args: &[Arg<'_>],
    ) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract (`Launcher::launch`).
        unsafe { module.launch(function, args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernels_parameters_are_read_from_its_source() {
        let code = "extern \"C\" __global__ void odc_x_f32(float* out, const unsigned short* q,\n    unsigned long long n, double scale) {}";
        assert_eq!(
            entry_points(code),
            vec![(
                "odc_x_f32".to_string(),
                vec![
                    "float*".to_string(),
                    "const unsigned short*".to_string(),
                    "unsigned long long".to_string(),
                    "double".to_string(),
                ]
            )]
        );
    }
}
