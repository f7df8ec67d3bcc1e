//! Multi-buffer signing core: eight independent signatures per instruction stream, one per 64-bit
//! lane of 512-bit registers, radix 2^52 limbs with AVX-512 IFMA. Synchronous; no tokio, no proxy
//! types. The only home of `unsafe` SIMD in the crate.

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
