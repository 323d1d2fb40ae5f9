//! Jobs on a real SLURM (issue 21, points 3 and 5): `slurmctld`, `slurmd` and `munge` from
//! Debian's packages, started by `tools/slurm-cluster.sh` — a single-node cluster, and two
//! nodes that are network namespaces of their own (one `slurmd` in each, its address on a
//! veth pair, its own hostname). Programs started by `srun` read their place from SLURM's
//! variables; `fsdp launch` started by `srun --ntasks-per-node=1` takes its machine from the
//! job step; `sbatch` runs a script. Each trains equal to one process (`fsdp test --worker`
//! checks every step's loss against one process). Needs root and the packages (`.ci/run`
//! installs them); skips with a reason otherwise. The daemons are stopped at the end.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common;

use crate::common::machines::Machines;
use crate::common::{Run, finish, fsdp};

const EXE: &str = env!("CARGO_BIN_EXE_fsdp");

/// A running SLURM cluster; on drop its daemons are stopped and its folder removed (kept
/// after a failure, for its logs).
struct Cluster {
    dir: PathBuf,
    /// The namespace of the node that runs slurmctld and the client commands, if any.
    netns: Option<String>,
}

impl Cluster {
    /// A cluster of `nodes` (`name:address[:netns]`; none: this host), or why not.
    fn start(nodes: &[String]) -> Result<Cluster, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: slurmd and munged cannot be started".into());
        }
        let found = |b: &str| {
            Command::new("sh")
                .args(["-c", &format!("command -v {b}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if let Some(b) = ["slurmctld", "slurmd", "srun", "munged"]
            .into_iter()
            .find(|b| !found(b))
        {
            return Err(format!(
                "{b} is not installed (Debian's slurmctld slurmd slurm-client munge; tools/install-cluster-packages.sh)"
            ));
        }
        let dir =
            std::env::temp_dir().join(format!("fsdp-slurm-{}-{}", std::process::id(), nodes.len()));
        let _ = std::fs::remove_dir_all(&dir);
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/slurm-cluster.sh");
        // Two ports free at once (slurmctld's, slurmd's): PORT+1 may be another's.
        let (a, b) = (
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
            std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        );
        let port = format!(
            "{},{}",
            a.local_addr().unwrap().port(),
            b.local_addr().unwrap().port()
        );
        drop((a, b));
        let out = Command::new("bash")
            .arg(script)
            .arg("start")
            .arg(&dir)
            .arg(&port)
            .args(nodes)
            .output()
            .map_err(|e| e.to_string())?;
        let cluster = Cluster {
            dir,
            netns: nodes
                .first()
                .and_then(|n| n.split(':').nth(2))
                .map(String::from),
        };
        if !out.status.success() {
            panic!(
                "starting SLURM: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(cluster)
    }

    /// The cluster, or `None` after a one-line reason.
    fn or_skip(nodes: &[String]) -> Option<Cluster> {
        Cluster::start(nodes)
            .inspect_err(|why| skipped!("{why}"))
            .ok()
    }

    /// `program ARGS` as a client of the cluster (in the first node's namespace), with the
    /// test environment of `fsdp()` (no FSDP_* variables).
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        };
        cmd.args(args);
        for (k, v) in fsdp().get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd.env("SLURM_CONF", self.dir.join("slurm.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    fn run(&self, program: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
        let mut cmd = self.command(program, args);
        cmd.envs(env.iter().copied());
        finish(cmd.spawn().unwrap(), Duration::from_secs(120))
    }
}

impl Cluster {
    /// Submits `script` with `sbatch --wait`; the job's output (the test fails when the job
    /// does).
    fn sbatch(&self, script: &str) -> String {
        static JOBS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let (file, out) = (
            self.dir.join(format!("job{n}.sbatch")),
            self.dir.join(format!("job{n}.out")),
        );
        std::fs::write(&file, script).unwrap();
        let output = format!("--output={}", out.display());
        let run = self.run("sbatch", &["--wait", &output, file.to_str().unwrap()], &[]);
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        assert_eq!(run.code, Some(0), "{script}\n{}\n{text}", run.out);
        text
    }
}

/// The launch guide's (docs/LAUNCH.md) batch script, as written there, for `nodes` nodes and `processes` processes,
/// training with `fsdp test --worker` instead of nlp_example (its check against one
/// process).
fn guide_sbatch(nodes: usize, processes: usize) -> String {
    let guide = include_str!("../../../docs/LAUNCH.md");
    let start = guide
        .find("#!/bin/sh\n  #SBATCH")
        .expect("the launch guide's batch script");
    let script: String = guide[start..]
        .lines()
        .take_while(|l| !l.trim_start().starts_with("```"))
        .map(|l| format!("{}\n", l.trim_start()))
        .collect();
    let swaps = [
        ("--nodes=1", format!("--nodes={nodes}")),
        ("--num_processes 2", format!("--num_processes {processes}")),
        (
            "target/release/examples/nlp_example --max_train_steps 4 --output_dir target/nlp_example_slurm",
            format!("{EXE} test --worker"),
        ),
        ("srun target/release/fsdp", format!("srun {EXE}")),
    ];
    swaps.iter().fold(script, |script, (from, to)| {
        assert!(
            script.contains(from),
            "the launch guide's script lacks {from:?}:\n{script}"
        );
        script.replacen(from, to, 1)
    })
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tools/slurm-cluster.sh");
        let _ = Command::new("bash")
            .arg(script)
            .arg("stop")
            .arg(&self.dir)
            .status();
        // The daemons' logs and state stay where a test failed, to read; a passing test
        // leaves nothing.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn assert_trained(run: &Run, n: usize) {
    assert_eq!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out
            .contains(&format!("training ok: 8 steps on {n} processes"))
            && run.out.contains("equal to one process"),
        "{}",
        run.out
    );
}

/// Run by `all_scenarios_that_mostly_wait_run_side_by_side`.
pub fn srun_sbatch_and_fsdp_launch_in_an_allocation_on_one_node() {
    let Some(cluster) = Cluster::or_skip(&[]) else {
        return;
    };
    let port = common::port();
    let master = [("MASTER_PORT", port.as_str())];

    // srun starts the processes; each reads its place from SLURM's variables.
    let run = cluster.run("srun", &["-n", "2", EXE, "test", "--worker"], &master);
    assert_trained(&run, 2);

    // srun's PMIx server makes it an MPI launcher: the processes communicate over MPI.
    #[cfg(feature = "mpi")]
    {
        let run = cluster.run(
            "srun",
            &["--mpi=pmix", "-n", "2", EXE, "test", "--worker"],
            &[master[0], ("FSDP_COMM_BACKEND", "mpi")],
        );
        assert_trained(&run, 2);
        assert!(run.out.contains("transport mpi"), "{}", run.out);
    }

    // One launcher per node from srun: it takes the machine from the job step.
    let run = cluster.run(
        "srun",
        &[
            "-N",
            "1",
            "--ntasks-per-node=1",
            EXE,
            "launch",
            "--num_processes",
            "2",
            EXE,
            "test",
            "--worker",
        ],
        &[],
    );
    assert_trained(&run, 2);

    // Two launchers on one node would each start the node's processes: refused.
    let run = cluster.run(
        "srun",
        &[
            "-n",
            "2",
            EXE,
            "launch",
            "--num_processes",
            "2",
            EXE,
            "test",
            "--worker",
        ],
        &[],
    );
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(run.out.contains("--ntasks-per-node=1"), "{}", run.out);

    // A batch script that starts the processes with srun, and the launch guide's, whose srun
    // starts one launcher per node.
    let script = format!(
        "#!/bin/sh\n#SBATCH --ntasks=2\nexport MASTER_PORT={port}\nsrun {EXE} test --worker\n"
    );
    let text = cluster.sbatch(&script);
    assert!(
        text.contains("training ok: 8 steps on 2 processes"),
        "{text}"
    );
    let text = cluster.sbatch(&guide_sbatch(1, 2));
    assert!(
        text.contains("training ok: 8 steps on 2 processes"),
        "{text}"
    );

    // A rank that dies ends the step with its rank named, and nothing of it is left.
    let run = cluster.run(
        "srun",
        &["-n", "3", EXE, "test", "--worker", "--fault", "die:1"],
        &master,
    );
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out.contains("task 1: Exited with exit code 3"),
        "{}",
        run.out
    );
    let pids = common::worker_pids(&run.out);
    assert_eq!(pids.len(), 3, "{}", run.out);
    common::assert_gone(&pids, Duration::from_secs(10), &run.out);
}

/// Run by `all_scenarios_that_mostly_wait_run_side_by_side`.
pub fn srun_across_two_nodes_on_a_real_network() {
    let Some(machines) = Machines::or_skip() else {
        return;
    };
    let nodes: Vec<String> = (0..2)
        .map(|i| format!("{0}:{1}:{0}", machines.names[i], machines.addrs[i]))
        .collect();
    let Some(cluster) = Cluster::or_skip(&nodes) else {
        return;
    };
    let port = common::port();
    let run = cluster.run(
        "srun",
        &["-N", "2", "--ntasks-per-node=2", EXE, "test", "--worker"],
        &[("MASTER_PORT", port.as_str())],
    );
    assert_trained(&run, 4);
    assert!(
        run.out
            .contains("ranks (rank:local@machine): 0:0@0 1:1@0 2:0@1 3:1@1"),
        "two ranks on each node:\n{}",
        run.out
    );
    assert!(
        run.out.contains("transport tcp"),
        "TCP between the nodes:\n{}",
        run.out
    );

    // Under srun's PMIx, auto picks MPI between the nodes.
    #[cfg(feature = "mpi")]
    {
        let run = cluster.run(
            "srun",
            &[
                "--mpi=pmix",
                "-N",
                "2",
                "--ntasks-per-node=2",
                EXE,
                "test",
                "--worker",
            ],
            &[("MASTER_PORT", port.as_str())],
        );
        assert_trained(&run, 4);
        assert!(
            run.out.contains("transport mpi"),
            "MPI between the nodes:\n{}",
            run.out
        );
    }

    // fsdp launch, one per node: machine rank, count and address from the job step.
    let per_node = [
        "-N",
        "2",
        "--ntasks-per-node=1",
        EXE,
        "launch",
        "--num_processes",
        "4",
        EXE,
        "test",
        "--worker",
    ];
    let run = cluster.run("srun", &per_node, &[("FSDP_JOB_SECRET", "slurm-two-nodes")]);
    assert_trained(&run, 4);
    // The launch guide's batch script on two nodes.
    let text = cluster.sbatch(&guide_sbatch(2, 4));
    assert!(
        text.contains("training ok: 8 steps on 4 processes"),
        "{text}"
    );
    // Without a shared secret the launchers refuse at once, saying how to set one.
    let run = cluster.run("srun", &per_node, &[]);
    assert_ne!(run.code, Some(0), "{}", run.out);
    assert!(
        run.out.contains("FSDP_JOB_SECRET is not set"),
        "{}",
        run.out
    );
}
