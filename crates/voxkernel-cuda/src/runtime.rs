//! Finding the CUDA driver, compiling the kernel sources with NVRTC to a CUBIN for the device's
//! architecture, and caching that CUBIN on disk.

use std::ffi::{CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cudarc::driver::{
    CudaContext, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nvrtc::{Ptx, result as nvrtc_result, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

/// The megakernel source: the frame kernel (and the head + sampling of a prefill), built for
/// launches of up to `FULL_BATCH` sequences.
pub const FRAME_SOURCE: &str = include_str!("../kernels/frame.cu");

/// The same kernel built for launches of up to `MAX_BATCH` sequences (`WIDE`: its loops over
/// the sequences run that wide), which many sessions share.
pub const WIDE_FRAME_SOURCE: &str =
    concat!("#define WIDE 1\n", include_str!("../kernels/frame.cu"));

/// The same kernel built for launches of one sequence (`SOLO`: its passes of one row run
/// loops one row wide).
pub const SOLO_FRAME_SOURCE: &str =
    concat!("#define SOLO 1\n", include_str!("../kernels/frame.cu"));

/// The streaming codec decoder's kernels (`CudaCodec`) and the voice encoders'
/// (`CudaVoiceEncoder`, which reuse the decoder's GEMM), compiled and cached as one module.
pub const CODEC_SOURCE: &str = concat!(
    include_str!("../kernels/async_copy.cuh"),
    include_str!("../kernels/codec.cu"),
    include_str!("../kernels/encoder.cu")
);

/// The batched prefill's kernels (tensor-core products and the row kernels between them),
/// compiled and cached on their own.
pub const PREFILL_SOURCE: &str = concat!(
    include_str!("../kernels/async_copy.cuh"),
    include_str!("../kernels/prefill.cu")
);

/// Environment variable naming a prebuilt CUBIN (for example from `nvcc -cubin -arch=sm_90a`)
/// to load instead of compiling `FRAME_SOURCE`. Without `SOLO_CUBIN_ENV` it serves launches of
/// one sequence too, so that nothing is compiled.
pub const CUBIN_ENV: &str = "VOXKERNEL_CUBIN";

/// Environment variable naming a prebuilt CUBIN to load instead of compiling
/// `SOLO_FRAME_SOURCE`.
pub const SOLO_CUBIN_ENV: &str = "VOXKERNEL_SOLO_CUBIN";

/// Environment variable naming a prebuilt CUBIN to load instead of compiling
/// `WIDE_FRAME_SOURCE`. Where `CUBIN_ENV` is set and this is not, there is no wide build:
/// launches carry what the given CUBIN carries.
pub const WIDE_CUBIN_ENV: &str = "VOXKERNEL_WIDE_CUBIN";

/// True when the CUDA driver library can be loaded. Every GPU entry point checks this first,
/// because cudarc panics on first use when the library is missing.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the driver library; calls nothing in it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub(crate) fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen libnvrtc; calls nothing in it.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Opens device 0, or says clearly why not.
pub fn open_device() -> Result<Arc<CudaContext>> {
    if !driver_available() {
        bail!("no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed?)");
    }
    CudaContext::new(0).context("creating a CUDA context on device 0")
}

/// `sm_90a` on Hopper (the `a` target allows Hopper-only instructions), `sm_XY` elsewhere.
pub fn arch_name(major: i32, minor: i32) -> String {
    if major == 9 && minor == 0 {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

fn driver_version() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: the driver library is loaded (checked by open_device) and `v` is a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .context("cuDriverGetVersion")?;
    Ok(v)
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("voxkernel"))
}

/// The cache key: the source, the target architecture and the driver version.
pub fn cache_key(source: &str, arch: &str, driver: i32) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(arch.as_bytes());
    h.update(driver.to_le_bytes());
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A zeroed device buffer of `len` elements (at least one, so that its address is valid),
/// named in the error if it cannot be had.
pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(len.max(1))
        .with_context(|| format!("allocating {what} ({len} elements)"))
}

/// A buffer's device address, for the kernels' parameter structs.
pub(crate) fn device_ptr<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    slice.device_ptr(stream).0
}

/// The frame kernel's builds: for launches of several sequences, of one, and of many.
pub struct FrameModules {
    pub full: Arc<CudaModule>,
    pub solo: Arc<CudaModule>,
    pub wide: Option<Arc<CudaModule>>,
}

/// Loads the frame-kernel builds: each from its CUBIN environment variable when set (see
/// `CUBIN_ENV`), else from the cache, else compiled with NVRTC (all at once) and cached.
pub fn load_frame_modules(ctx: &Arc<CudaContext>) -> Result<FrameModules> {
    let given = |var: &str| -> Result<Option<Vec<u8>>> {
        std::env::var_os(var)
            .map(|path| {
                std::fs::read(&path)
                    .with_context(|| format!("{var}={}: cannot read", Path::new(&path).display()))
            })
            .transpose()
    };
    let full = given(CUBIN_ENV)?;
    let solo = given(SOLO_CUBIN_ENV)?.or_else(|| full.clone());
    let wide = given(WIDE_CUBIN_ENV)?;
    let compile_wide = wide.is_none() && full.is_none();
    let (major, minor) = ctx.compute_capability()?;
    let (arch, driver) = (arch_name(major, minor), driver_version()?);
    let cubin = |given: Option<Vec<u8>>, name: &str, source: &str| match given {
        Some(cubin) => Ok(cubin),
        None => cached_or_compiled(name, source, &arch, driver),
    };
    let (full, solo, wide) = std::thread::scope(|scope| {
        let joined = |handle: std::thread::ScopedJoinHandle<'_, Result<Vec<u8>>>| {
            handle
                .join()
                .map_err(|_| anyhow::anyhow!("the NVRTC thread panicked"))?
        };
        let solo = scope.spawn(|| cubin(solo, "frame-solo", SOLO_FRAME_SOURCE));
        let compiling_wide =
            compile_wide.then(|| scope.spawn(|| cubin(None, "frame-wide", WIDE_FRAME_SOURCE)));
        let full = cubin(full, "frame", FRAME_SOURCE)?;
        let solo = joined(solo)?;
        let wide = match compiling_wide {
            Some(handle) => Some(joined(handle)?),
            None => wide,
        };
        anyhow::Ok((full, solo, wide))
    })?;
    let load = |cubin: Vec<u8>, what: &str| {
        ctx.load_module(Ptx::from_binary(cubin))
            .with_context(|| format!("loading the {what} frame kernel CUBIN into the context"))
    };
    Ok(FrameModules {
        full: load(full, "full")?,
        solo: load(solo, "solo")?,
        wide: wide.map(|cubin| load(cubin, "wide")).transpose()?,
    })
}

/// Loads the module of another kernel source (cached as `name`), compiling it on first use.
pub fn load_source(ctx: &Arc<CudaContext>, name: &str, source: &str) -> Result<Arc<CudaModule>> {
    let (major, minor) = ctx.compute_capability()?;
    let cubin = cached_or_compiled(name, source, &arch_name(major, minor), driver_version()?)?;
    ctx.load_module(Ptx::from_binary(cubin))
        .with_context(|| format!("loading the {name} kernel CUBIN into the context"))
}

fn cached_or_compiled(name: &str, source: &str, arch: &str, driver: i32) -> Result<Vec<u8>> {
    let key = cache_key(source, arch, driver);
    let path = cache_dir().map(|d| d.join(format!("{name}-{arch}-{key}.cubin")));
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
    {
        return Ok(bytes);
    }
    eprintln!(
        "voxkernel: compiling the {name} CUDA kernels for {arch} with NVRTC (once; cached)..."
    );
    let started = std::time::Instant::now();
    let cubin = compile_cubin(source, arch)?.cubin;
    eprintln!(
        "voxkernel: {name} kernels compiled in {:.1} s",
        started.elapsed().as_secs_f32()
    );
    if let Some(p) = &path {
        // A cache that cannot be written only costs a recompile next time.
        if let Some(dir) = p.parent()
            && std::fs::create_dir_all(dir).is_ok()
        {
            let tmp = p.with_extension("tmp");
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok(cubin)
}

/// A compiled module and NVRTC's log, which holds ptxas's resource report (`-Xptxas=-v`).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Compiles `source` to a CUBIN for `arch` (cudarc's safe API only returns PTX).
pub fn compile_cubin(source: &str, arch: &str) -> Result<Compiled> {
    if !nvrtc_available() {
        bail!(
            "NVRTC (libnvrtc.so.13) could not be loaded: add the CUDA 13 lib directory to \
             LD_LIBRARY_PATH, or set {CUBIN_ENV} to a prebuilt CUBIN"
        );
    }
    let src = CString::new(source).context("kernel source contains a NUL byte")?;
    let prog = nvrtc_result::create_program(&src, Some(c"frame.cu")).context("nvrtc create")?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
        "-Xptxas=-v".to_string(),
    ];
    // SAFETY: `prog` was created above and is destroyed exactly once at the end.
    let compiled = unsafe { nvrtc_result::compile_program(prog, &options) };
    let outcome = match compiled {
        Ok(()) => read_cubin(prog).map(|cubin| Compiled {
            cubin,
            log: program_log(prog),
        }),
        Err(e) => Err(anyhow::anyhow!(
            "NVRTC failed to compile the kernels for {arch}: {e:?}\n{}",
            program_log(prog)
        )),
    };
    // SAFETY: see above; `prog` is not used after this.
    unsafe { nvrtc_result::destroy_program(prog) }.context("nvrtc destroy")?;
    outcome
}

fn read_cubin(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: `prog` is a successfully compiled program; `size` is a valid out-pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .context("nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .context("nvrtcGetCUBIN")?;
    Ok(cubin)
}

/// One function's line of ptxas's resource report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionResources {
    pub name: String,
    pub stack_frame: u64,
    pub spill_stores: u64,
    pub spill_loads: u64,
}

/// Parses ptxas's `-v` report: "Function properties for NAME" followed by
/// ". S bytes stack frame, T bytes spill stores, L bytes spill loads".
pub fn resource_report(log: &str) -> Vec<FunctionResources> {
    let mut out = Vec::new();
    let mut name: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            name = Some(rest.trim().to_string());
        } else if let Some(n) = name.take() {
            let number_before = |what: &str| -> Option<u64> {
                let head = line.split(what).next()?;
                head.rsplit(|c: char| !c.is_ascii_digit())
                    .find(|s| !s.is_empty())?
                    .parse()
                    .ok()
            };
            if let (Some(stack_frame), Some(spill_stores), Some(spill_loads)) = (
                number_before(" bytes stack frame"),
                number_before(" bytes spill stores"),
                number_before(" bytes spill loads"),
            ) {
                out.push(FunctionResources {
                    name: n,
                    stack_frame,
                    spill_stores,
                    spill_loads,
                });
            }
        }
    }
    out
}

fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    // SAFETY: `prog` is a valid program handle.
    match unsafe { nvrtc_result::get_program_log(prog) } {
        Ok(log) => {
            let bytes: Vec<u8> = log
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let base = cache_key("src", "sm_90a", 13000);
        assert_ne!(base, cache_key("src2", "sm_90a", 13000));
        assert_ne!(base, cache_key("src", "sm_89", 13000));
        assert_ne!(base, cache_key("src", "sm_90a", 13010));
        assert_eq!(base, cache_key("src", "sm_90a", 13000));
    }

    #[test]
    fn hopper_gets_the_arch_specific_target() {
        assert_eq!(arch_name(9, 0), "sm_90a");
        assert_eq!(arch_name(8, 9), "sm_89");
    }

    #[test]
    fn resource_report_reads_every_function() {
        let log = "ptxas info    : Compiling entry function 'frame_kernel' for 'sm_90a'\n\
                   ptxas info    : Function properties for frame_kernel\n\
                   ptxas         .     192 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 128 registers, used 1 barriers\n\
                   ptxas info    : Function properties for embed_rows\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        assert_eq!(
            resource_report(log),
            vec![
                FunctionResources {
                    name: "frame_kernel".into(),
                    stack_frame: 192,
                    spill_stores: 8,
                    spill_loads: 12
                },
                FunctionResources {
                    name: "embed_rows".into(),
                    stack_frame: 0,
                    spill_stores: 0,
                    spill_loads: 0
                },
            ]
        );
    }

    /// Every kernel source compiles for Hopper without register spills (local-memory traffic
    /// in the hot loops). Needs NVRTC but no GPU: scripts/test.sh installs PyPI's
    /// nvidia-cuda-nvrtc wheel and points LD_LIBRARY_PATH at it.
    #[test]
    fn kernels_compile_for_sm_90a_without_spills() {
        assert!(
            nvrtc_available(),
            "NVRTC (libnvrtc.so.13) is needed: run ./scripts/test.sh, which installs it"
        );
        let builds = [
            ("frame", FRAME_SOURCE, "frame_kernel"),
            ("frame (solo)", SOLO_FRAME_SOURCE, "frame_kernel"),
            ("frame (wide)", WIDE_FRAME_SOURCE, "frame_kernel"),
            ("codec", CODEC_SOURCE, ""),
            ("prefill", PREFILL_SOURCE, "gemm"),
        ];
        // A kernel no earlier compile has seen: the GPU machine's NVRTC (13.0.88) answers a
        // source that differs from one it compiled before only in a comment from a cache, in
        // 0.022 s and with an empty log (no ptxas report); a new kernel makes it compile afresh.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let unique = format!(
            "\nextern \"C\" __global__ void spill_check_{}() {{}}\n",
            now.unwrap_or_default().as_nanos()
        );
        let compiles: Vec<_> = builds
            .into_iter()
            .map(|(what, source, kernel)| {
                let source = format!("{source}{unique}");
                std::thread::spawn(move || (what, kernel, compile_cubin(&source, "sm_90a")))
            })
            .collect();
        for handle in compiles {
            let (what, kernel, compiled) = handle.join().expect("compile thread");
            let compiled = compiled.unwrap_or_else(|e| panic!("{what}: {e:#}"));
            assert_eq!(&compiled.cubin[..4], b"\x7fELF");
            let report = resource_report(&compiled.log);
            assert!(
                !report.is_empty()
                    && (kernel.is_empty() || report.iter().any(|f| f.name == kernel)),
                "{what}: no resource report for the kernels in the log:\n{}",
                compiled.log
            );
            for f in &report {
                assert!(
                    f.spill_stores == 0 && f.spill_loads == 0,
                    "{what}: {} spills registers ({} bytes stored, {} loaded)",
                    f.name,
                    f.spill_stores,
                    f.spill_loads
                );
            }
        }
    }
}
