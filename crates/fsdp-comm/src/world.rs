//! Reading a worker's place in the job from its environment: the torchrun contract that
//! `fsdp launch` sets, and the variables SLURM, Open MPI and MPICH's Hydra set.

use std::collections::HashMap;

/// Which launcher's variables described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK`, `WORLD_SIZE`, ... as set by `fsdp launch` and torchrun.
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, ...
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, ...
    OpenMpi,
    /// `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` (MPICH's Hydra `mpiexec`).
    Mpich,
    /// No launcher variables: a single process.
    Standalone,
}

/// A worker's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldInfo {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this machine.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// This machine's index.
    pub node_rank: usize,
    /// Address of the rendezvous store (rank 0's machine).
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Where these values came from.
    pub launcher: Launcher,
    /// The launcher starts every line of this process's output with its rank (`fsdp
    /// launch`'s `[rankN]: `), so logs need not repeat it.
    pub output_prefixed: bool,
    /// Which attempt of the job this is: 0 for the first, counting up with each restart after
    /// a failure (`FSDP_RESTART_COUNT`, torchrun's `TORCHELASTIC_RESTART_COUNT`).
    pub restart_count: u32,
}

/// A launch environment that is incomplete or contradictory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorldError {
    /// A variable is set but not a number of the right range.
    #[error("environment variable {var}={value:?} is not valid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// One variable of a launcher's set is there but a required one is missing.
    #[error("{launcher:?} launch environment is incomplete: {var} is not set")]
    Missing {
        /// The launcher whose variables were found.
        launcher: Launcher,
        /// The missing variable.
        var: &'static str,
    },
    /// The values contradict each other.
    #[error("inconsistent launch environment: {0}")]
    Inconsistent(String),
}

/// Default rendezvous port, as torchrun's.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

struct Vars<'a>(&'a HashMap<String, String>);

impl Vars<'_> {
    fn get(&self, var: &str) -> Option<&str> {
        self.0
            .get(var)
            .map(String::as_str)
            .filter(|v| !v.trim().is_empty())
    }

    fn number(&self, var: &'static str) -> Result<Option<usize>, WorldError> {
        self.get(var)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| WorldError::Invalid {
                    var,
                    value: v.to_string(),
                    reason: "expected a non-negative whole number".into(),
                })
            })
            .transpose()
    }

    fn required(&self, launcher: Launcher, var: &'static str) -> Result<usize, WorldError> {
        self.number(var)?
            .ok_or(WorldError::Missing { launcher, var })
    }

    /// `FSDP_RESTART_COUNT`, else torchrun's `TORCHELASTIC_RESTART_COUNT`, else 0.
    fn restart_count(&self) -> Result<u32, WorldError> {
        let n = match self.number(crate::options::RESTART_COUNT_ENV)? {
            Some(n) => Some(n),
            None => self.number("TORCHELASTIC_RESTART_COUNT")?,
        };
        Ok(n.unwrap_or(0).min(u32::MAX as usize) as u32)
    }

    fn port(&self) -> Result<u16, WorldError> {
        match self.get("MASTER_PORT") {
            None => Ok(DEFAULT_MASTER_PORT),
            Some(v) => v.trim().parse::<u16>().map_err(|_| WorldError::Invalid {
                var: "MASTER_PORT",
                value: v.to_string(),
                reason: "expected a port number 0..65535".into(),
            }),
        }
    }

    /// The layout an MPI launcher gives from its variables for rank, size, local rank and
    /// local size. MPI launchers name no node index (Open MPI's OMPI_COMM_WORLD_NODE_RANK is
    /// a rank within the node): with their default by-slot mapping, ranks fill node after
    /// node.
    fn mpi(
        &self,
        l: Launcher,
        [rank, size, local_rank, local_size]: [&'static str; 4],
    ) -> Result<WorldInfo, WorldError> {
        let world_size = self.required(l, size)?;
        let local_world_size = self.number(local_size)?.unwrap_or(world_size);
        let rank = self.required(l, rank)?;
        Ok(WorldInfo {
            rank,
            world_size,
            local_rank: self.number(local_rank)?.unwrap_or(0),
            local_world_size,
            node_rank: rank / local_world_size.max(1),
            master_addr: self.addr(),
            master_port: self.port()?,
            launcher: l,
            output_prefixed: false,
            restart_count: 0,
        })
    }

    fn addr(&self) -> String {
        self.get("MASTER_ADDR").unwrap_or("127.0.0.1").to_string()
    }

    /// `MASTER_ADDR`, else the allocation's first host (where task 0 runs), else loopback.
    fn slurm_addr(&self) -> String {
        match self.get("MASTER_ADDR") {
            Some(a) => a.to_string(),
            None => ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .iter()
                .find_map(|v| first_host(self.get(v)?))
                .unwrap_or_else(|| "127.0.0.1".into()),
        }
    }
}

/// The first host of a SLURM host list (`node[01-04,07],gpu5` gives `node01`,
/// `rack[1-2]-n[3-4]` gives `rack1-n3`): the first entry, each bracket replaced by the
/// first number of its first range, zero padding kept.
pub fn first_host(hostlist: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = hostlist.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let inside: String = chars.by_ref().take_while(|&c| c != ']').collect();
                let first = inside.split([',', '-']).next()?.trim();
                if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                out.push_str(first);
            }
            c => out.push(c),
        }
    }
    (!out.is_empty()).then_some(out)
}

impl WorldInfo {
    /// Reads this process's environment.
    pub fn from_env() -> Result<WorldInfo, WorldError> {
        let vars: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        WorldInfo::from_vars(&vars)
    }

    /// Reads a given set of variables: torchrun's if `RANK` is set, else SLURM's if
    /// `SLURM_PROCID` is, else Open MPI's if `OMPI_COMM_WORLD_RANK` is, else MPICH's if
    /// `PMI_RANK` is, else a single process.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<WorldInfo, WorldError> {
        let v = Vars(vars);
        let info = if v.get("RANK").is_some() {
            let l = Launcher::Torchrun;
            let world_size = v.required(l, "WORLD_SIZE")?;
            let local_world_size = v.number("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
            WorldInfo {
                rank: v.required(l, "RANK")?,
                world_size,
                local_rank: v.number("LOCAL_RANK")?.unwrap_or(0),
                local_world_size,
                node_rank: v
                    .number("NODE_RANK")?
                    .or(v.number("GROUP_RANK")?)
                    .unwrap_or(0),
                master_addr: v.addr(),
                master_port: v.port()?,
                launcher: l,
                output_prefixed: v.get(crate::options::OUTPUT_PREFIXED_ENV) == Some("1"),
                restart_count: v.restart_count()?,
            }
        } else if v.get("SLURM_PROCID").is_some() {
            let l = Launcher::Slurm;
            let world_size = v.required(l, "SLURM_NTASKS")?;
            let nodes = v.number("SLURM_NNODES")?.unwrap_or(1).max(1);
            let node = v.number("SLURM_NODEID")?.unwrap_or(0);
            // The step's tasks on each node ("2(x3),1": SLURM's block layout may give nodes
            // different counts), else the job's, else an even split.
            let local_world_size = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
                .iter()
                .find_map(|var| tasks_on_node(v.get(var)?, node))
                .or_else(|| {
                    v.get("SLURM_NTASKS_PER_NODE")
                        .and_then(|t| t.split(['(', ',']).next()?.trim().parse().ok())
                })
                .unwrap_or(world_size.div_ceil(nodes));
            WorldInfo {
                rank: v.required(l, "SLURM_PROCID")?,
                world_size,
                local_rank: v.number("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size,
                node_rank: node,
                master_addr: v.slurm_addr(),
                master_port: v.port()?,
                launcher: l,
                output_prefixed: false,
                // SLURM's own count of requeues of the job.
                restart_count: v.number("SLURM_RESTART_COUNT")?.unwrap_or(0) as u32,
            }
        } else if v.get("OMPI_COMM_WORLD_RANK").is_some() {
            v.mpi(
                Launcher::OpenMpi,
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            )?
        } else if v.get("PMI_RANK").is_some() {
            v.mpi(
                Launcher::Mpich,
                ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            )?
        } else {
            WorldInfo {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                node_rank: 0,
                master_addr: v.addr(),
                master_port: v.port()?,
                launcher: Launcher::Standalone,
                output_prefixed: false,
                restart_count: 0,
            }
        };
        info.check()?;
        Ok(info)
    }

    fn check(&self) -> Result<(), WorldError> {
        let fail = |m: String| Err(WorldError::Inconsistent(m));
        if self.world_size == 0 {
            return fail("world size is 0".into());
        }
        if self.rank >= self.world_size {
            return fail(format!(
                "rank {} is not below world size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            return fail(format!(
                "local rank {} is not below local world size {}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.local_world_size > self.world_size {
            return fail(format!(
                "local world size {} exceeds world size {}",
                self.local_world_size, self.world_size
            ));
        }
        Ok(())
    }
}

/// The number of tasks on node `node` from SLURM's per-node list (`"2(x3),1"`: two on each
/// of the first three nodes, then one); `None` when the list does not parse or is too short.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0usize;
    for entry in list.split(',') {
        let (count, repeat) = match entry.trim().split_once("(x") {
            Some((c, r)) => (
                c.trim().parse::<usize>().ok()?,
                r.strip_suffix(')')?.trim().parse::<usize>().ok()?,
            ),
            None => (entry.trim().parse::<usize>().ok()?, 1),
        };
        seen = seen.checked_add(repeat)?;
        if node < seen {
            return Some(count);
        }
    }
    None
}

/// Whether this process was started by an MPI launcher (Open MPI's `mpirun`, MPICH's
/// Hydra, or a PMIx server such as `srun --mpi=pmix`), from the variables they set.
pub fn started_under_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn torchrun_contract() {
        let w = WorldInfo::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (
                w.rank,
                w.world_size,
                w.local_rank,
                w.local_world_size,
                w.node_rank
            ),
            (3, 4, 1, 2, 1)
        );
        assert_eq!(
            (w.master_addr.as_str(), w.master_port, w.launcher),
            ("10.1.2.3", 1234, Launcher::Torchrun)
        );
        // torchrun itself prefixes nothing; `fsdp launch` says it does. The first attempt.
        assert!(!w.output_prefixed);
        assert_eq!(w.restart_count, 0);
        let w = WorldInfo::from_vars(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            (crate::options::OUTPUT_PREFIXED_ENV, "1"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]))
        .unwrap();
        assert!(w.output_prefixed);
        assert_eq!(w.restart_count, 2);
    }

    #[test]
    fn slurm_and_openmpi() {
        let w = WorldInfo::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NNODES", "4"),
            ("SLURM_NTASKS_PER_NODE", "2(x4)"),
        ]))
        .unwrap();
        assert_eq!(
            (
                w.rank,
                w.world_size,
                w.local_rank,
                w.local_world_size,
                w.node_rank
            ),
            (5, 8, 1, 2, 2)
        );
        assert_eq!(w.master_addr, "127.0.0.1");
        // SLURM's block layout of 4 tasks on 2 nodes of 4 CPUs is 3 and 1.
        for (node, local) in [("0", 3), ("1", 1)] {
            let w = WorldInfo::from_vars(&vars(&[
                ("SLURM_PROCID", "2"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", node),
                ("SLURM_NNODES", "2"),
                ("SLURM_STEP_TASKS_PER_NODE", "3,1"),
            ]))
            .unwrap();
            assert_eq!(w.local_world_size, local, "node {node}");
        }
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("2(x", 0), None);
        let w = WorldInfo::from_vars(&vars(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]))
        .unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.node_rank, w.launcher),
            (3, 4, 1, 1, Launcher::Mpich)
        );
        // Across nodes, task 0 runs on the allocation's first host.
        let w = WorldInfo::from_vars(&vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "cn[007-009,012],gpu1"),
        ]))
        .unwrap();
        assert_eq!(w.master_addr, "cn007");
        let w = WorldInfo::from_vars(&vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "cn[007-009]"),
            ("MASTER_ADDR", "10.0.0.9"),
        ]))
        .unwrap();
        assert_eq!(w.master_addr, "10.0.0.9", "MASTER_ADDR wins");
        let w = WorldInfo::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!((w.rank, w.node_rank, w.launcher), (3, 1, Launcher::OpenMpi));
        // The second process on the first node (Open MPI sets NODE_RANK 1 there).
        let w = WorldInfo::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
        ]))
        .unwrap();
        assert_eq!((w.local_rank, w.node_rank), (1, 0));
    }

    #[test]
    fn standalone_and_errors() {
        let w = WorldInfo::from_vars(&vars(&[])).unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.master_port),
            (0, 1, DEFAULT_MASTER_PORT)
        );
        let err = WorldInfo::from_vars(&vars(&[("RANK", "0")])).unwrap_err();
        assert_eq!(
            err,
            WorldError::Missing {
                launcher: Launcher::Torchrun,
                var: "WORLD_SIZE"
            }
        );
        let err = WorldInfo::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(
            err.to_string().contains("rank 2 is not below world size 2"),
            "{err}"
        );
        let err = WorldInfo::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK=\"x\""), "{err}");
    }

    #[test]
    fn the_first_host_of_a_slurm_host_list() {
        for (list, first) in [
            ("node1", Some("node1")),
            ("node[01-04,07],gpu5", Some("node01")),
            ("gpu5,node[1-2]", Some("gpu5")),
            ("rack[1-2]-n[3-4]", Some("rack1-n3")),
            ("n[10,2]", Some("n10")),
            ("", None),
            ("n[x-y]", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
    }
}
