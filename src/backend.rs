//! Which copy backend a rank runs on: the choice between the host backend ([`crate::copy`]) and
//! the CUDA backend (`crate::cuda`, feature `cuda`), made here, above both, so that neither names
//! the other.

use crate::copy::{host, EngineArenas};
#[cfg(not(feature = "cuda"))]
use crate::error::CopyError;
use crate::geometry::Geometry;

/// Which copy backend to run on (`--backend` of the `kvtier` command line and the examples).
///
/// Parses from and displays as `auto`, `host`, `cuda` ([`BackendKind::NAMES`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize), serde(rename_all = "lowercase"))]
pub enum BackendKind {
    /// CUDA if this build has the `cuda` feature and a GPU is present, else host.
    #[default]
    Auto,
    /// Host memory stands in for GPU arenas ([`host::MemcpyArenas`]).
    Host,
    /// Real HBM arenas on a GPU (feature `cuda`).
    Cuda,
}

impl BackendKind {
    /// Every kind, in the order of [`BackendKind::NAMES`].
    pub const ALL: [BackendKind; 3] = [BackendKind::Auto, BackendKind::Host, BackendKind::Cuda];

    /// The names [`BackendKind`] parses from and displays as.
    pub const NAMES: [&'static str; 3] = ["auto", "host", "cuda"];

    /// Short lower-case name: `auto`, `host` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => Self::NAMES[0],
            BackendKind::Host => Self::NAMES[1],
            BackendKind::Cuda => Self::NAMES[2],
        }
    }

    /// `Auto` resolved for this machine: `Cuda` or `Host`.
    pub fn resolve(self) -> BackendKind {
        match self {
            BackendKind::Auto if cuda_present() => BackendKind::Cuda,
            BackendKind::Auto => BackendKind::Host,
            k => k,
        }
    }

    /// Devices this backend spreads ranks over: the GPU count for CUDA (at least 1), 1 for host.
    pub fn devices(self) -> u32 {
        match self.resolve() {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => crate::cuda::device_count().unwrap_or(1).max(1),
            _ => 1,
        }
    }

    /// Allocates one rank's engine arenas for `geometry` on device `device` (ignored by the host
    /// backend).
    ///
    /// # Errors
    /// [`crate::CopyError::Unavailable`] for CUDA in a build without the `cuda` feature or on a machine
    /// without a GPU; allocation and device errors.
    pub fn arenas(self, device: u32, geometry: &Geometry) -> Result<std::sync::Arc<dyn EngineArenas>, crate::Error> {
        match self.resolve() {
            BackendKind::Cuda => cuda_arenas(device, geometry),
            _ => Ok(std::sync::Arc::new(std::sync::Arc::new(host::MemcpyArenas::new(geometry)?))),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    /// Parses `auto`, `host` or `cuda` (exactly, lower case).
    ///
    /// # Errors
    /// A message naming the input and the known kinds, e.g.
    /// ``unknown backend `gpu` (known: auto, host, cuda)``.
    fn from_str(s: &str) -> Result<Self, String> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown backend `{s}` (known: {})", BackendKind::NAMES.join(", ")))
    }
}

#[cfg(feature = "cuda")]
fn cuda_present() -> bool {
    crate::cuda::cuda_available()
}

#[cfg(not(feature = "cuda"))]
fn cuda_present() -> bool {
    false
}

#[cfg(feature = "cuda")]
fn cuda_arenas(device: u32, geometry: &Geometry) -> Result<std::sync::Arc<dyn EngineArenas>, crate::Error> {
    let a = crate::cuda::CudaArenas::new(device, geometry, crate::cuda::CudaOptions::default())?;
    Ok(std::sync::Arc::new(a))
}

#[cfg(not(feature = "cuda"))]
fn cuda_arenas(_device: u32, _geometry: &Geometry) -> Result<std::sync::Arc<dyn EngineArenas>, crate::Error> {
    Err(CopyError::Unavailable {
        backend: "cuda",
        reason: "this kvtier was built without CUDA support; rebuild it with \
                 `cargo build --release --features cuda` (or use --backend host)"
            .into(),
    }
    .into())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::BackendKind;

    #[test]
    fn backend_kind_parses_its_own_names() {
        for k in BackendKind::ALL {
            assert_eq!(k.to_string().parse::<BackendKind>(), Ok(k));
        }
        assert_eq!("cuda".parse::<BackendKind>(), Ok(BackendKind::Cuda));
        assert_eq!("gpu".parse::<BackendKind>(), Err("unknown backend `gpu` (known: auto, host, cuda)".to_string()));
        assert_eq!("Host".parse::<BackendKind>(), Err("unknown backend `Host` (known: auto, host, cuda)".to_string()));
    }
}
