//! `fsdp launch` as a task of a SLURM job step (`srun --ntasks-per-node=1 fsdp launch ...`,
//! in an allocation or a batch script): the number of machines, this machine's rank and
//! machine 0's address come from the step's variables (`SLURM_NNODES`, `SLURM_NODEID`, the
//! first host of `SLURM_STEP_NODELIST`), as a configuration layer below the flags — a flag
//! still wins.

use std::collections::HashMap;
use std::net::ToSocketAddrs;

use anyhow::{Result, bail};
use fsdp::config::{Key, Layer, Source, Value};

/// Whether these variables are those of a task that `srun` started.
fn in_step(vars: &HashMap<String, String>) -> bool {
    vars.contains_key("SLURM_STEP_ID") || vars.contains_key("SLURM_STEPID")
}

/// The layer of what the job step says, empty outside `srun`. Errors name the variable, or
/// say how to start one launcher per node.
pub(super) fn step_layer(vars: &HashMap<String, String>) -> Result<Layer> {
    let mut layer = Layer::new();
    if !in_step(vars) {
        return Ok(layer);
    }
    let number = |var: &str| -> Result<Option<u64>> {
        match vars.get(var) {
            None => Ok(None),
            Some(v) => match v.trim().parse::<u64>() {
                Ok(n) => Ok(Some(n)),
                Err(_) => bail!("{var}={v:?} is not a number (set by SLURM for this job step)"),
            },
        }
    };
    let first = |names: &[&str]| -> Result<Option<(String, u64)>> {
        for n in names {
            if let Some(v) = number(n)? {
                return Ok(Some((n.to_string(), v)));
            }
        }
        Ok(None)
    };
    let (Some((nodes_var, nodes)), Some((id_var, node_id))) = (
        first(&["SLURM_STEP_NUM_NODES", "SLURM_NNODES"])?,
        first(&["SLURM_NODEID"])?,
    ) else {
        return Ok(layer);
    };
    if let Some((tasks_var, tasks)) = first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?
        && tasks != nodes
    {
        bail!(
            "srun started {tasks} launchers ({tasks_var}) on {nodes} nodes ({nodes_var}): `fsdp launch` starts every process of its machine, so start one per node: srun --ntasks-per-node=1 fsdp launch ..."
        );
    }
    let env = |var: &str| Source::Env { var: var.into() };
    layer.set(Key::NumMachines, Value::UInt(nodes), env(&nodes_var));
    layer.set(Key::MachineRank, Value::UInt(node_id), env(&id_var));
    let (list_var, list) = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .iter()
    .find_map(|v| Some((*v, vars.get(*v)?)))
    .map(|(v, l)| (v.to_string(), l.clone()))
    .unwrap_or_default();
    let Some(host) = fsdp_comm::first_host(&list) else {
        bail!("{list_var}={list:?}: no first host to rendezvous on");
    };
    let addr = (host.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| a.is_ipv4()))
        .map(|a| a.ip().to_string());
    let Some(addr) = addr else {
        bail!(
            "the job step's first host `{host}` (from {list_var}) does not resolve to an IPv4 address on this node"
        );
    };
    layer.set(Key::MainProcessIp, Value::Text(addr), env(&list_var));
    Ok(layer)
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
    fn a_step_task_gets_its_machine_from_slurm() {
        let l = step_layer(&vars(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_NODELIST", "localhost,other"),
        ]))
        .unwrap();
        assert_eq!(l.get(Key::NumMachines).unwrap().value, Value::UInt(2));
        assert_eq!(l.get(Key::MachineRank).unwrap().value, Value::UInt(1));
        assert_eq!(
            l.get(Key::MainProcessIp).unwrap().value,
            Value::Text("127.0.0.1".into())
        );
    }

    #[test]
    fn outside_a_step_nothing_and_two_tasks_per_node_are_refused() {
        assert!(
            step_layer(&vars(&[("SLURM_JOB_ID", "7"), ("SLURM_NNODES", "2")]))
                .unwrap()
                .is_empty()
        );
        let e = step_layer(&vars(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NODELIST", "localhost"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("--ntasks-per-node=1"), "{e}");
    }
}
