//! One memory budget and what it sizes: where the figure comes from (the
//! `--memory-budget` flag, else the container's cgroup limit, else a fixed
//! default) and the share of it each cache and buffer may hold, so that a
//! sidecar's memory is set by its configuration, not by what it stores.

use std::path::Path;

/// The budget when neither the flag nor a cgroup limit gives one.
pub const DEFAULT_BUDGET_BYTES: u64 = 128 << 20;

/// Below this, the fixed costs (runtime, sled's buffers, connections) leave
/// nothing to share.
pub const MIN_BUDGET_BYTES: u64 = 32 << 20;

/// Where the budget's figure came from (logged at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSource {
    /// `--memory-budget`.
    Flag,
    /// The container's cgroup memory limit.
    Cgroup,
    /// [`DEFAULT_BUDGET_BYTES`].
    Default,
}

/// The memory the sidecar plans for, and its shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    pub bytes: u64,
    pub source: BudgetSource,
}

impl MemoryBudget {
    /// The flag's value if given, else the limit of the cgroup mounted at
    /// `cgroup_root` (v2 `memory.max`, or v1 `memory/memory.limit_in_bytes`),
    /// else the default. A cgroup limit below the minimum is used as the
    /// minimum: the container's limit is the operator's, and refusing to
    /// start would help no one.
    pub fn resolve(flag: Option<u64>, cgroup_root: &Path) -> Result<MemoryBudget, String> {
        if let Some(bytes) = flag {
            if bytes < MIN_BUDGET_BYTES {
                return Err(format!(
                    "--memory-budget {} is below the minimum of {}",
                    show(bytes),
                    show(MIN_BUDGET_BYTES)
                ));
            }
            return Ok(MemoryBudget {
                bytes,
                source: BudgetSource::Flag,
            });
        }
        Ok(match cgroup_limit(cgroup_root) {
            Some(limit) => MemoryBudget {
                bytes: limit.max(MIN_BUDGET_BYTES),
                source: BudgetSource::Cgroup,
            },
            None => MemoryBudget {
                bytes: DEFAULT_BUDGET_BYTES,
                source: BudgetSource::Default,
            },
        })
    }

    /// The embedded store's page cache (or a shared store's local tier
    /// cache): an eighth. sled's memory beyond its cache — node copies of
    /// writes, pages read and not yet evicted — and jemalloc's freed pages
    /// come on top (docs/memory.md measures them).
    pub fn store_cache_bytes(&self) -> u64 {
        (self.bytes / 8).clamp(4 << 20, 1 << 30)
    }

    /// Bytes of request messages held at once: a quarter (the gRPC guard
    /// raises it to one largest message).
    pub fn read_budget_bytes(&self) -> usize {
        usize::try_from((self.bytes / 4).min(256 << 20)).unwrap_or(usize::MAX)
    }
}

/// The container's memory limit, if it has one.
fn cgroup_limit(root: &Path) -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(root.join(path)).ok();
    let limit = match read("memory.max") {
        // cgroup v2: "max" means no limit.
        Some(text) => text.trim().parse::<u64>().ok()?,
        // cgroup v1: no limit reads as a huge number (near i64::MAX,
        // rounded down to a page).
        None => read("memory/memory.limit_in_bytes")?
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&bytes| bytes < 1 << 60)?,
    };
    Some(limit)
}

/// Parses a size: bytes, or a number with a binary (`Ki`, `Mi`, `Gi`, also
/// written `KiB`, `MiB`, `GiB`) or decimal (`K`, `M`, `G`, `KB`, `MB`,
/// `GB`) suffix, as Kubernetes writes memory limits.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (like 256MiB, 1Gi or 268435456)"))?;
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "K" | "KB" | "k" | "kB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, Ki, Mi, Gi, K, M or G)"
            ))
        }
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// A size for messages: MiB when whole, else bytes.
pub fn show(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 20) {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_kubernetes_writes_them() {
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("256Mi"), Ok(256 << 20));
        assert_eq!(parse_size("1Gi"), Ok(1 << 30));
        assert_eq!(parse_size("64M"), Ok(64_000_000));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size(" 2 GiB "), Ok(2 << 30));
        for bad in ["", "MiB", "12XB", "-5Mi", "1.5Gi", "99999999999999999999Gi"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parse_size("18446744073709551615Ki")
            .unwrap_err()
            .contains("too large"));
    }

    fn cgroup(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        root
    }

    #[test]
    fn the_budget_comes_from_the_flag_then_the_cgroup_then_the_default() {
        let v2 = cgroup(&[("memory.max", "268435456\n")]);
        assert_eq!(
            MemoryBudget::resolve(Some(64 << 20), v2.path()),
            Ok(MemoryBudget {
                bytes: 64 << 20,
                source: BudgetSource::Flag
            })
        );
        assert_eq!(
            MemoryBudget::resolve(None, v2.path()),
            Ok(MemoryBudget {
                bytes: 256 << 20,
                source: BudgetSource::Cgroup
            })
        );
        let v1 = cgroup(&[("memory/memory.limit_in_bytes", "536870912\n")]);
        assert_eq!(
            MemoryBudget::resolve(None, v1.path()).unwrap().bytes,
            512 << 20
        );
        for unlimited in [
            cgroup(&[("memory.max", "max\n")]),
            cgroup(&[("memory/memory.limit_in_bytes", "9223372036854771712\n")]),
            cgroup(&[]),
        ] {
            assert_eq!(
                MemoryBudget::resolve(None, unlimited.path()),
                Ok(MemoryBudget {
                    bytes: DEFAULT_BUDGET_BYTES,
                    source: BudgetSource::Default
                })
            );
        }
        let tiny = cgroup(&[("memory.max", "16777216")]);
        assert_eq!(
            MemoryBudget::resolve(None, tiny.path()).unwrap().bytes,
            MIN_BUDGET_BYTES
        );
        let refused = MemoryBudget::resolve(Some(8 << 20), v2.path()).unwrap_err();
        assert!(refused.contains("below the minimum of 32MiB"), "{refused}");
    }

    #[test]
    fn the_shares_follow_the_budget() {
        let budget = |bytes| MemoryBudget {
            bytes,
            source: BudgetSource::Flag,
        };
        assert_eq!(budget(64 << 20).store_cache_bytes(), 8 << 20);
        assert_eq!(budget(64 << 20).read_budget_bytes(), 16 << 20);
        assert_eq!(budget(32 << 20).store_cache_bytes(), 4 << 20);
        assert_eq!(budget(64 << 30).store_cache_bytes(), 1 << 30);
        assert_eq!(budget(64 << 30).read_budget_bytes(), 256 << 20);
    }
}
