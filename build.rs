//! Compiles the eBPF redirect program (src/redirect/mbtunnel.bpf.c) with clang for the BPF
//! target; the object is embedded in the binary (src/redirect/ebpf.rs). No prebuilt object is
//! committed. scripts/deps.sh installs clang and the kernel UAPI headers (linux-libc-dev).
//! Also generates the control-plane protocol code from proto/ (see `protos`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    protos();
    ebpf();
    build_info();
}

/// The compiler and profile this binary was built with, for the config dump's `version`
/// (ztunnel's build info). The git revision comes from `MBTUNNEL_GIT_REVISION` when the builder
/// sets it (the Dockerfile does); otherwise the dump says "unknown".
fn build_info() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=MBTUNNEL_RUSTC_VERSION={version}");
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown".into());
    println!("cargo:rustc-env=MBTUNNEL_BUILD_PROFILE={profile}");
    println!("cargo:rerun-if-env-changed=MBTUNNEL_GIT_REVISION");
}

/// Istio's xDS, workload, authorization and CA protos (proto/) → prost messages and tonic
/// client/server stubs. Needs `protoc` and the well-known types (scripts/deps.sh installs
/// protobuf-compiler and libprotobuf-dev).
fn protos() {
    let files =
        ["proto/xds.proto", "proto/workload.proto", "proto/authorization.proto", "proto/ca.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    if let Err(e) = tonic_prost_build::configure().compile_protos(&files, &["proto"]) {
        panic!(
            "cannot compile {files:?}: {e}. Install protoc and the protobuf well-known types \
             (scripts/deps.sh installs protobuf-compiler and libprotobuf-dev), or set PROTOC"
        );
    }
}

fn ebpf() {
    let src = "src/redirect/mbtunnel.bpf.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CLANG");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    // <asm/types.h> lives under the multiarch include directory on Debian.
    let multiarch = Command::new("gcc")
        .arg("-print-multiarch")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{}-linux-gnu", std::env::consts::ARCH));
    // Two objects from one source: maps pinned by name (fail-closed mode, state that outlives
    // the process) and not pinned (everything goes away with the process).
    for (name, pinning) in [("mbtunnel.bpf.o", "0"), ("mbtunnel-pinned.bpf.o", "1")] {
        let status = Command::new(&clang)
            .args(["-O2", "-Wall", "-Werror", "-target", "bpf"])
            .arg(format!("-DMBT_PINNING={pinning}"))
            .args(["-c", src, "-o"])
            .arg(out_dir.join(name))
            .arg(format!("-I/usr/include/{multiarch}"))
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{clang} failed to compile {src} ({s}); see the messages above"),
            Err(e) => panic!(
                "cannot run {clang} to compile the eBPF redirect program {src}: {e}. \
                 Install clang and linux-libc-dev (scripts/deps.sh does), or set CLANG=/path/to/clang"
            ),
        }
    }
}
