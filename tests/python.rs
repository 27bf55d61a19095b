//! The Python package (`python/`): built into a wheel by maturin, installed into a virtual
//! environment that has no Rust toolchain on its PATH, and its pytest suite run there — what a
//! user's `pip install ./python` and `import odc` do.
//!
//! Environments live under `target/python/` and are reused: `tools` (maturin,
//! `python/env/tools.txt`) and `venv` (what the tests import: pytest, numpy, torch, transformers,
//! and the wheel; and ruff: `python/env/test.txt`). `python/env/make.py` makes each, again when
//! its requirements change. Every command has a deadline and its output is shown when it fails.
//!
//! Without a Python 3.9+ interpreter (`ODC_PYTHON`, else `python3`), or without the package
//! registry to install from, the test says that it skipped and why; with `ODC_REQUIRE_PYTHON=1`
//! (CI's `.ci/run`) a skip is a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// An event file as the examples' `--tensorboard` writes it (`odc::recipe::tensorboard`), in a
/// fresh directory, for `python/tests/test_tensorboard.py` to read with TensorBoard's reader;
/// the scalars it holds, as the test expects them.
fn tensorboard_events() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tensorboard-events");
    let _ = std::fs::remove_dir_all(&dir);
    let mut writer = odc::recipe::tensorboard::EventWriter::create(&dir).unwrap();
    for step in 1..=3u64 {
        let loss = 4.0 / step as f64;
        writer
            .scalars(step, &[("loss", loss), ("mfu", 0.01 * step as f64)])
            .unwrap();
    }
    writer.scalars(3, &[("eval_loss", 1.5)]).unwrap();
    dir
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace's target directory (the parent of this test's scratch directory).
fn target() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is inside the target directory")
        .to_path_buf()
}

fn required() -> bool {
    std::env::var("ODC_REQUIRE_PYTHON").is_ok_and(|v| v == "1")
}

/// Skips with the reason, or fails with it where a skip is not allowed.
fn skip(reason: &str) {
    assert!(
        !required(),
        "ODC_REQUIRE_PYTHON=1 and the Python tests cannot run: {reason}"
    );
    eprintln!(
        "SKIPPED: the Python package's tests: {reason} (ODC_REQUIRE_PYTHON=1 makes this fail)"
    );
}

/// Runs `cmd` to its end within `limit`; its combined output, or why it failed with that output.
fn run(what: &str, cmd: &mut Command, limit: Duration) -> Result<String, String> {
    let log = target().join("python").join(format!("{what}.log"));
    std::fs::create_dir_all(log.parent().unwrap()).map_err(|e| e.to_string())?;
    let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("{what}: cannot start {cmd:?}: {e}"))?;
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait().map_err(|e| format!("{what}: {e}"))? {
            Some(status) => break status,
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("{what}: still running after {limit:?}\n{text}"));
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    if status.success() {
        Ok(text)
    } else {
        Err(format!("{what}: {cmd:?} exited with {status}\n{text}"))
    }
}

/// The interpreter to make environments from, if there is one of at least 3.9.
fn interpreter() -> Result<String, String> {
    let python = std::env::var("ODC_PYTHON").unwrap_or_else(|_| "python3".into());
    let check = "import sys; assert sys.version_info >= (3, 9), sys.version; print(sys.version)";
    let mut cmd = Command::new(&python);
    cmd.args(["-c", check]);
    match run("interpreter", &mut cmd, Duration::from_secs(30)) {
        Ok(_) => Ok(python),
        Err(e) => Err(format!(
            "no Python 3.9+ as `{python}` ({})",
            e.lines().next().unwrap_or("")
        )),
    }
}

/// A virtual environment at `dir` with the requirements of `python/env/<file>`, made (again)
/// unless it has exactly them, by `python/env/make.py` (which `.ci/run` also runs, ahead).
fn environment(python: &str, dir: &Path, file: &str) -> Result<PathBuf, String> {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    let env = root().join("python").join("env");
    let mut make = Command::new(python);
    make.arg(env.join("make.py")).arg(dir).arg(env.join(file));
    match run(&format!("{name}-env"), &mut make, Duration::from_secs(1200)) {
        Ok(_) => Ok(dir.join("bin")),
        Err(e) if e.contains("exited with exit status: 3") => Err(format!(
            "cannot install python/env/{file} from the package registry: {e}"
        )),
        Err(e) => Err(e),
    }
}

/// The wheel maturin builds from `python/` (the workspace's target directory, the dev profile).
fn wheel(tools: &Path) -> Result<PathBuf, String> {
    let out = target().join("python").join("wheels");
    let _ = std::fs::remove_dir_all(&out);
    let mut build = Command::new(tools.join("maturin"));
    build
        .args(["build", "--profile", "dev", "--manifest-path"])
        .arg(root().join("python").join("Cargo.toml"))
        .arg("--out")
        .arg(&out)
        .env("CARGO_TARGET_DIR", target());
    run("maturin-build", &mut build, Duration::from_secs(1200))?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => Err(format!(
            "maturin made {} wheels, expected one: {other:?}",
            other.len()
        )),
    }
}

#[test]
fn the_python_package_builds_into_a_wheel_that_installs_and_passes_its_tests() {
    let python = match interpreter() {
        Ok(python) => python,
        Err(reason) => return skip(&reason),
    };
    let dir = target().join("python");
    let envs = environment(&python, &dir.join("tools"), "tools.txt")
        .and_then(|tools| Ok((tools, environment(&python, &dir.join("venv"), "test.txt")?)));
    let (tools, venv) = match envs {
        Ok(envs) => envs,
        // A machine without the registry cannot make the environments: a skip, named.
        Err(reason) if reason.contains("package registry") => return skip(&reason),
        Err(reason) => panic!("{reason}"),
    };
    let wheel = wheel(&tools).unwrap_or_else(|e| panic!("{e}"));
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.contains("-cp39-abi3-") && name.contains("manylinux"),
        "the wheel is not a manylinux wheel of the stable ABI: {name}"
    );
    let mut install = Command::new(venv.join("python"));
    install
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .args(["--force-reinstall", "--no-deps"])
        .arg(&wheel);
    run("install", &mut install, Duration::from_secs(300)).unwrap_or_else(|e| panic!("{e}"));
    // The tests import the installed wheel, from outside the source tree, with no Rust
    // toolchain on the PATH.
    let mut pytest = Command::new(venv.join("python"));
    pytest
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
        ])
        .arg(root().join("python").join("tests"))
        .current_dir(env!("CARGO_TARGET_TMPDIR"))
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", venv.display()))
        .env("HOME", env!("CARGO_TARGET_TMPDIR"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("ODC_TENSORBOARD_EVENTS", tensorboard_events());
    let out =
        run("pytest", &mut pytest, Duration::from_secs(900)).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{out}");
    // A pytest skip (torch not importable, say) is a failure where skips are (CI).
    let summary = out
        .lines()
        .rev()
        .find(|l| l.contains(" passed") || l.contains(" skipped"))
        .unwrap_or("");
    assert!(
        !(required() && summary.contains("skipped")),
        "ODC_REQUIRE_PYTHON=1 and pytest skipped tests: {summary}\n{out}"
    );
}
