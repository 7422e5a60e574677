//! Kernels compiled twice, baseline and with AVX2/FMA/F16C, the variant picked at run time
//! ([`multiversion!`]). Every slice kernel of [`float`](crate::float) is written once, as plain
//! branch-free scalar code, through it.

/// Whether the AVX2 variants of the kernels may run on this CPU (std caches the probe).
#[inline(always)]
pub(super) fn has_avx2() -> bool {
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

/// Defines a kernel compiled twice: baseline and with AVX2/FMA/F16C enabled (so its loop
/// vectorizes 8 lanes wide), the variant picked at run time. The body is written once, as plain
/// branch-free scalar code.
macro_rules! multiversion {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?) $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name $(<$g: $bound>)? ($($arg: $ty),*) {
            #[inline(always)]
            fn portable $(<$g: $bound>)? ($($arg: $ty),*) $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2 $(<$g: $bound>)? ($($arg: $ty),*) {
                portable $(::<$g>)? ($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if $crate::float::multiversion::has_avx2() {
                // SAFETY: `avx2` requires only that the CPU supports AVX2, FMA and F16C, which
                // `has_avx2` has just checked.
                return unsafe { avx2 $(::<$g>)? ($($arg),*) };
            }
            portable $(::<$g>)? ($($arg),*)
        }
    };
}

pub(super) use multiversion;
