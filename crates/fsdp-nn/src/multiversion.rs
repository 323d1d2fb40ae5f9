//! Kernels compiled for several instruction sets and chosen at run time: the element-wise
//! kernels of `ops` and the optimizer updates of `fsdp::optim` share one dispatch.

/// Defines `pub(crate) fn $name(args)` that runs `$body` compiled for the best instruction
/// set this CPU has (exported for `fsdp`'s optimizer kernels, not an API of its own).
#[doc(hidden)]
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name($($arg: $ty),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn portable<const FMA: bool>($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx512($($arg: $ty),*) {
                    portable::<true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) {
                    portable::<true>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU has the features `avx512` is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            portable::<false>($($arg),*)
        }
    };
}
