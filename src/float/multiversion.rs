//! Kernels compiled three times, baseline, with AVX2/FMA/F16C and with AVX-512, the variant picked
//! at run time ([`multiversion!`]). Every slice kernel of [`float`](crate::float), and the row
//! kernels of the fused attention kernel, are written once, as plain branch-free scalar code,
//! through it.
//!
//! The variants compute the same bits: Rust never contracts `a * b + c` into a fused
//! multiply-add on its own (a body that wants one says `mul_add`, exact in every variant), and
//! the bodies use no reduction whose order the vector width could change, so only the speed
//! depends on the CPU.

/// Whether the AVX2 variants of the kernels may run on this CPU (std caches the probe).
#[inline(always)]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512 variants of the kernels may run on this CPU (F, BW, VL on top of AVX2).
#[inline(always)]
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Defines a kernel compiled three times: baseline, with AVX2/FMA/F16C (its loop vectorizes 8
/// lanes wide) and with AVX-512 (16 lanes), the variant picked at run time. The body is written
/// once, as plain branch-free scalar code.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident $(<$($g:ident: $bound:path),+>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                portable $(::<$($g),+>)? ($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn avx512 $(<$($g: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
                portable $(::<$($g),+>)? ($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if $crate::float::multiversion::has_avx512() {
                // SAFETY: `avx512` requires only that the CPU supports AVX-512 F/BW/VL, AVX2, FMA
                // and F16C, which `has_avx512` has just checked.
                return unsafe { avx512 $(::<$($g),+>)? ($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::float::multiversion::has_avx2() {
                // SAFETY: `avx2` requires only that the CPU supports AVX2, FMA and F16C, which
                // `has_avx2` has just checked.
                return unsafe { avx2 $(::<$($g),+>)? ($($arg),*) };
            }
            portable $(::<$($g),+>)? ($($arg),*)
        }
    };
}

pub(crate) use multiversion;
