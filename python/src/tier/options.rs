//! The options of `Tier(...)` read from Python: the pool's backing, the policy, a rank's geometry,
//! `cuda_options`, the SSD tier's files and options, and `Tier.ssd_stats` as a dict.

use crate::errors::{IntoPyResult, Raised};
use crate::geometry::ArenaView;
use kvtier::BackingChoice;
use kvtier::{ArenaSpec, CopyError, Geometry, PolicyKind};
use kvtier::{CopyMode, CudaOptions};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

pub(crate) fn config_error(message: String) -> PyErr {
    Raised::custom("ConfigError", message).into()
}

/// A pool backing name of `Tier(..., backing=...)`: `auto`, `hugetlb`, `thp`, `plain`.
///
/// Raises: `ConfigError` for another name.
pub(crate) fn parse_backing(backing: &str) -> PyResult<BackingChoice> {
    Ok(match backing {
        "auto" => BackingChoice::Auto,
        "hugetlb" => BackingChoice::HugeTlb,
        "thp" => BackingChoice::TransparentHuge,
        "plain" => BackingChoice::Plain,
        b => return Err(config_error(format!("unknown backing `{b}` (auto, hugetlb, thp, plain)"))),
    })
}

/// An eviction policy name of `Tier(..., policy=...)`.
///
/// Raises: `ConfigError` for an unknown name (the message lists the known ones).
pub(crate) fn parse_policy(policy: &str) -> PyResult<PolicyKind> {
    policy.parse::<PolicyKind>().map_err(|e| config_error(e.to_string()))
}

pub(super) fn rank_geometry(tier: &Geometry, views: &[ArenaView]) -> PyResult<Geometry> {
    if views.len() != tier.arenas().len() {
        return Err(Raised::from(&CopyError::ArenaCount { given: views.len(), arenas: tier.arenas().len() }).into());
    }
    let mut specs = Vec::with_capacity(views.len());
    for (v, a) in views.iter().zip(tier.arenas()) {
        if v.bytes_per_page != a.bytes_per_page {
            return Err(Raised::from(&CopyError::PageBytesMismatch {
                arena: a.name.clone(),
                given: v.bytes_per_page,
                geometry: a.bytes_per_page,
            })
            .into());
        }
        specs.push(ArenaSpec { page_stride: v.page_stride, pages: v.pages, ..a.clone() });
    }
    let g = Geometry::new(tier.model(), tier.page_tokens(), specs).py()?;
    match tier.shard() {
        Some((i, n)) => g.with_shard(i, n).py(),
        None => Ok(g),
    }
}

pub(super) fn parse_cuda_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<CudaOptions> {
    let mut o = CudaOptions::default();
    let Some(d) = options else { return Ok(o) };
    for (k, v) in d.iter() {
        let k: String = k.extract()?;
        match k.as_str() {
            "mode" => {
                o.mode = match v.extract::<String>()?.as_str() {
                    "auto" => CopyMode::Auto,
                    "zero-copy" => CopyMode::ZeroCopy,
                    "staged" => CopyMode::Staged,
                    m => return Err(config_error(format!("unknown copy mode `{m}` (auto, zero-copy, staged)"))),
                }
            }
            "save_ctas" => o.save_ctas = v.extract()?,
            "restore_ctas" => o.restore_ctas = v.extract()?,
            "staged_ctas" => o.staged_ctas = v.extract()?,
            "staged_piece_blocks" => o.staged_piece_blocks = v.extract()?,
            "high_priority" => o.high_priority = v.extract()?,
            "reserved_sms" => o.reserved_sms = v.extract()?,
            "batched_copies" => o.batched_copies = v.extract()?,
            "save_head_bytes" => o.save_head_bytes = v.extract()?,
            "restore_head_bytes" => o.restore_head_bytes = v.extract()?,
            _ => {
                return Err(config_error(format!(
                    "unknown CUDA option `{k}` (mode, save_ctas, restore_ctas, staged_ctas, \
                     staged_piece_blocks, high_priority, reserved_sms, batched_copies, save_head_bytes, \
                     restore_head_bytes)"
                )))
            }
        }
    }
    Ok(o)
}

/// The `ssd_*` keyword arguments of `Tier(...)`; None: kvtier's default.
pub(super) struct SsdOptions<'a> {
    pub(super) admit_uses: Option<u32>,
    pub(super) io: Option<&'a str>,
    pub(super) read_depth: Option<usize>,
}

/// One `(path, bytes)` pair of `Tier(..., ssd=...)`.
fn ssd_file(item: &Bound<'_, PyAny>) -> PyResult<(std::path::PathBuf, u64)> {
    item.extract::<(std::path::PathBuf, u64)>().map_err(|_| {
        let shown = item.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        config_error(format!("ssd: each file is a (path, bytes) pair (bytes: a non-negative int), not {shown}"))
    })
}

/// The `SsdConfig` of `Tier(..., ssd=..., ssd_admit_uses=..., ssd_io=..., ssd_read_depth=...)`,
/// or None without `ssd`. `ssd`: one `(path, bytes)` pair or a sequence of them (one file per
/// drive). The options' ranges are checked by kvtier when the tier opens the files.
pub(super) fn parse_ssd(ssd: Option<&Bound<'_, PyAny>>, o: SsdOptions<'_>) -> PyResult<Option<kvtier::SsdConfig>> {
    let Some(ssd) = ssd.filter(|s| !s.is_none()) else {
        if o.admit_uses.is_some() || o.io.is_some() || o.read_depth.is_some() {
            return Err(config_error(
                "ssd_admit_uses, ssd_io and ssd_read_depth need an SSD tier: pass ssd=[(path, bytes)]".into(),
            ));
        }
        return Ok(None);
    };
    // One pair (a tuple whose first item is not itself a pair), or a sequence of pairs; a str or
    // bytes is a path without its size.
    let one_pair = match ssd.cast::<PyTuple>() {
        Ok(t) => {
            t.len() == 2 && !(t.get_item(0)?.is_instance_of::<PyTuple>() || t.get_item(0)?.is_instance_of::<PyList>())
        }
        Err(_) => false,
    };
    let files = if one_pair {
        vec![ssd_file(ssd)?]
    } else if ssd.is_instance_of::<pyo3::types::PyString>() || ssd.is_instance_of::<PyBytes>() {
        return Err(config_error(format!(
            "ssd: a (path, bytes) pair or a list of them, not the path {} alone",
            ssd.repr()?
        )));
    } else {
        ssd.try_iter()?.map(|f| ssd_file(&f?)).collect::<PyResult<Vec<_>>>()?
    };
    let mut files = files.into_iter();
    let Some((path, bytes)) = files.next() else {
        return Err(config_error("ssd: an SSD tier needs at least one (path, bytes) file".into()));
    };
    let mut cfg = kvtier::SsdConfig::new(path, bytes);
    for (path, bytes) in files {
        cfg = cfg.with_file(path, bytes);
    }
    if let Some(uses) = o.admit_uses {
        cfg = cfg.with_admit_uses(uses);
    }
    if let Some(io) = o.io {
        cfg = cfg.with_io(match io {
            "direct" => kvtier::IoPreference::Direct,
            "buffered" => kvtier::IoPreference::Buffered,
            m => return Err(config_error(format!("unknown ssd_io `{m}` (direct, buffered)"))),
        });
    }
    if let Some(depth) = o.read_depth {
        cfg = cfg.with_read_depth(depth);
    }
    Ok(Some(cfg))
}

/// The SSD tier's counters (`Tier.ssd_stats`) as a dict of ints.
pub(super) fn ssd_stats_dict<'py>(py: Python<'py>, s: &kvtier::SsdStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let fields: [(&str, u64); 17] = [
        ("capacity", s.capacity),
        ("blocks", s.blocks),
        ("recovered_blocks", s.recovered_blocks),
        ("recovered_torn", s.recovered_torn),
        ("recovered_foreign", s.recovered_foreign),
        ("demoted_blocks", s.demoted_blocks),
        ("bytes_demoted", s.bytes_demoted),
        ("demotions_skipped", s.demotions_skipped),
        ("demotions_dropped", s.demotions_dropped),
        ("demotion_failures", s.demotion_failures),
        ("demotions_pending", s.demotions_pending),
        ("promoted_blocks", s.promoted_blocks),
        ("bytes_promoted", s.bytes_promoted),
        ("promotion_failures", s.promotion_failures),
        ("disk_evictions", s.disk_evictions),
        ("io_direct", s.io_direct),
        ("io_buffered", s.io_buffered),
    ];
    for (name, v) in fields {
        d.set_item(name, v)?;
    }
    Ok(d)
}
