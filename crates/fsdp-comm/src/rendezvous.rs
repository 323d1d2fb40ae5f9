//! Joining a group through the rendezvous store: claiming a rank, agreeing on the size,
//! connecting every pair of members (with the job secret in each greeting), and setting up
//! the shared-memory segment when every member runs on this host, and later the shared blocks
//! its collectives that copy once use.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::options::{GroupOptions, TRANSPORT_ENV, TransportChoice};
use crate::shm::{BlocksGroup, Segment, SharedBlocks};
use crate::store::{StoreClient, Waited, constant_time_eq};

const HELLO_MAGIC: &[u8; 8] = b"FSDPHELO";

/// This host's identity: members with the same one can share memory.
fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// Creates (member 0) or maps (the others) the group's shared-memory segment when every
/// member runs on this host and the options allow it. Member 0 unlinks the file once all have
/// mapped it, so nothing is left in /dev/shm even if a process crashes later.
pub(crate) fn setup_shm(
    store: &StoreClient,
    name: &str,
    me: usize,
    members: &[usize],
    options: &GroupOptions,
) -> Result<Option<Arc<Segment>>> {
    let rank = members[me];
    let n = members.len();
    if options.transport == TransportChoice::Tcp || n < 2 {
        return Ok(None);
    }
    store.set(&format!("{name}/host/{me}"), host_id().as_bytes())?;
    let keys: Vec<String> = (0..n).map(|i| format!("{name}/host/{i}")).collect();
    if let Err(missing) = store.wait(&keys, options.rendezvous_timeout)? {
        return Err(CommError::RendezvousTimeout {
            rank,
            missing: missing_members(&missing, members),
            timeout: options.rendezvous_timeout,
        });
    }
    let mine = host_id();
    let mut same_host = true;
    for key in &keys {
        same_host &= store.get(key)?.as_deref() == Some(mine.as_bytes());
    }
    if !same_host {
        return match options.transport {
            TransportChoice::Shm => Err(CommError::InvalidArgument {
                rank,
                op: "process group initialisation".into(),
                reason: format!(
                    "{TRANSPORT_ENV}=shm but the members of group `{name}` are on different hosts"
                ),
            }),
            _ => Ok(None),
        };
    }
    let io = |what: &str, e: std::io::Error| CommError::Io {
        rank,
        what: what.to_string(),
        message: e.to_string(),
    };
    let path_key = format!("{name}/shm_path");
    let mapped_keys: Vec<String> = (1..n).map(|i| format!("{name}/shm_mapped/{i}")).collect();
    if me == 0 {
        let path = crate::shm::segment_path(name);
        let seg = Segment::create(&path, n, me)
            .map_err(|e| io(&format!("creating shared memory {}", path.display()), e))?;
        let unlink = Unlink(path.clone());
        store.set(&path_key, path.to_string_lossy().as_bytes())?;
        if let Err(missing) = store.wait(&mapped_keys, options.rendezvous_timeout)? {
            return Err(CommError::RendezvousTimeout {
                rank,
                missing: missing_members(&missing, members),
                timeout: options.rendezvous_timeout,
            });
        }
        drop(unlink);
        Ok(Some(Arc::new(seg)))
    } else {
        if let Err(missing) =
            store.wait(std::slice::from_ref(&path_key), options.rendezvous_timeout)?
        {
            return Err(CommError::RendezvousTimeout {
                rank,
                missing: missing_members(&missing, members),
                timeout: options.rendezvous_timeout,
            });
        }
        let path = std::path::PathBuf::from(
            String::from_utf8_lossy(&store.get(&path_key)?.unwrap_or_default()).into_owned(),
        );
        let seg = Segment::open(&path, n, me)
            .map_err(|e| io(&format!("mapping shared memory {}", path.display()), e))?;
        store.set(&format!("{name}/shm_mapped/{me}"), b"1")?;
        Ok(Some(Arc::new(seg)))
    }
}

/// What a group brings to [`setup_shared_blocks`]: its store, name, members and this rank's
/// place among them, options, segment and links' inbox.
pub(crate) struct BlocksRendezvous<'a> {
    pub store: &'a StoreClient,
    pub name: &'a str,
    pub me: usize,
    pub members: &'a [usize],
    pub options: &'a GroupOptions,
    pub seg: Arc<Segment>,
    pub inbox: Arc<crate::transport::Inbox>,
    pub bytes_sent: Arc<std::sync::atomic::AtomicU64>,
}

/// Makes the group's `id`th [`SharedBlocks`]: each rank creates its file, publishes its path
/// in the store, maps every rank's, and unlinks its own once every rank has mapped it (on
/// every error path too).
pub(crate) fn setup_shared_blocks(
    group: BlocksRendezvous<'_>,
    id: u64,
    block_bytes: usize,
    slots: usize,
) -> Result<SharedBlocks> {
    let (store, me, members) = (group.store, group.me, group.members);
    let (rank, n) = (members[me], members.len());
    let prefix = format!("{}/blocks/{id}", group.name);
    let path = crate::shm::segment_path(&format!("{}-blocks{id}-{me}", group.name));
    SharedBlocks::create_file(&path, n, block_bytes, slots).map_err(|e| CommError::Io {
        rank,
        what: format!("creating shared blocks {}", path.display()),
        message: e.to_string(),
    })?;
    let unlink = Unlink(path.clone());
    // Each rank's arguments travel with its path, so every rank refuses different ones alike
    // before mapping anything.
    let asked = format!("shared_blocks({block_bytes} bytes, {slots} slots, {n} ranks)");
    let entry = format!("{asked}\n{}", path.to_string_lossy());
    store.set(&format!("{prefix}/path/{me}"), entry.as_bytes())?;
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}/path/{i}")).collect();
    wait_or_stopped(store, &keys, rank, members, group.options)?;
    let mut paths = Vec::with_capacity(n);
    for (i, key) in keys.iter().enumerate() {
        let value = String::from_utf8_lossy(&store.get(key)?.unwrap_or_default()).into_owned();
        let (theirs, path) = value.split_once('\n').unwrap_or(("?", ""));
        if theirs != asked {
            return Err(CommError::Mismatch {
                rank,
                peer: members[i],
                mine: asked,
                theirs: theirs.to_string(),
            });
        }
        paths.push(std::path::PathBuf::from(path));
    }
    let blocks = SharedBlocks::open_all(
        BlocksGroup {
            seg: group.seg,
            inbox: group.inbox,
            me,
            global_ranks: members,
            timeout: group.options.timeout,
            bytes_sent: group.bytes_sent,
        },
        &paths,
        block_bytes,
        slots,
    )?;
    store.set(&format!("{prefix}/mapped/{me}"), b"1")?;
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}/mapped/{i}")).collect();
    wait_or_stopped(store, &keys, rank, members, group.options)?;
    drop(unlink);
    Ok(blocks)
}

/// Removes a file when dropped (on success and on every error path).
struct Unlink(std::path::PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Job-wide ranks of the members whose `.../<index>` keys are missing.
fn missing_members(missing: &[String], members: &[usize]) -> Vec<usize> {
    missing
        .iter()
        .filter_map(|k| k.rsplit('/').next()?.parse::<usize>().ok())
        .filter_map(|i| members.get(i).copied())
        .collect()
}

/// Waits until every key is set, failing at once when a launcher has stopped the job
/// (`ABORT_KEY` set: its machine's part failed), and with the members still missing at the
/// timeout.
fn wait_or_stopped(
    store: &StoreClient,
    keys: &[String],
    rank: usize,
    members: &[usize],
    options: &GroupOptions,
) -> Result<()> {
    let abort = format!("{}{}", options.store_prefix, crate::options::ABORT_KEY);
    match store.wait_unless(keys, &abort, options.rendezvous_timeout)? {
        Waited::Ready => Ok(()),
        Waited::Stopped(reason) => {
            // Which members had not arrived, for the message (best effort).
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| store.get(k).is_ok_and(|v| v.is_none()))
                .cloned()
                .collect();
            Err(CommError::JobStopped {
                rank,
                reason: format!(
                    "{} (rank(s) {:?} never joined)",
                    String::from_utf8_lossy(&reason),
                    missing_members(&missing, members)
                ),
            })
        }
        Waited::Missing(missing) => Err(CommError::RendezvousTimeout {
            rank,
            missing: missing_members(&missing, members),
            timeout: options.rendezvous_timeout,
        }),
    }
}

/// Registers this rank under `name` in the store and connects to every other member: lower
/// ranks dial higher ones' listeners. `me` is the index into `members` (global ranks).
pub(crate) fn connect_mesh(
    store: &StoreClient,
    name: &str,
    me: usize,
    members: &[usize],
    ip: &str,
    options: &GroupOptions,
) -> Result<Vec<Option<TcpStream>>> {
    let rank = members[me];
    let n = members.len();
    let io = |what: String, e: std::io::Error| CommError::Io {
        rank,
        what,
        message: e.to_string(),
    };
    let token = format!("{}-{:?}", std::process::id(), Instant::now());
    let claimed = store.compare_set(&format!("{name}/claim/{me}"), None, token.as_bytes())?;
    if claimed.as_deref() != Some(token.as_bytes()) {
        return Err(CommError::Refused {
            rank,
            reason: format!("rank {rank} of group `{name}` is already claimed by another process"),
        });
    }
    let size = n.to_string();
    let agreed = store.compare_set(&format!("{name}/size"), None, size.as_bytes())?;
    if agreed.as_deref() != Some(size.as_bytes()) {
        return Err(CommError::Refused {
            rank,
            reason: format!(
                "world size mismatch in group `{name}`: this rank has {n}, another rank registered {}",
                String::from_utf8_lossy(&agreed.unwrap_or_default())
            ),
        });
    }
    let listener = TcpListener::bind((ip, 0)).map_err(|e| io(format!("listening on {ip}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io("listener address".into(), e))?;
    store.set(&format!("{name}/addr/{me}"), addr.to_string().as_bytes())?;
    let keys: Vec<String> = (0..n).map(|i| format!("{name}/addr/{i}")).collect();
    wait_or_stopped(store, &keys, rank, members, options)?;
    let deadline = Instant::now() + options.rendezvous_timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    for (peer, key) in keys.iter().enumerate().take(me) {
        let peer_addr = String::from_utf8_lossy(&store.get(key)?.unwrap_or_default()).into_owned();
        let target = peer_addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                io(
                    format!("resolving rank {}'s address {peer_addr}", members[peer]),
                    std::io::Error::other("bad address"),
                )
            })?;
        let mut stream =
            TcpStream::connect_timeout(&target, Duration::from_secs(10)).map_err(|e| {
                io(
                    format!("connecting to rank {} at {peer_addr}", members[peer]),
                    e,
                )
            })?;
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&(me as u32).to_le_bytes());
        hello.extend_from_slice(&(options.secret.len() as u32).to_le_bytes());
        hello.extend_from_slice(&options.secret);
        stream
            .write_all(&hello)
            .map_err(|e| io(format!("greeting rank {}", members[peer]), e))?;
        streams[peer] = Some(stream);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| io("listener".into(), e))?;
    let mut expected = n - 1 - me;
    while expected > 0 {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Some(peer) = read_hello(&mut stream, &options.secret, n)
                    && peer > me
                    && streams[peer].is_none()
                {
                    streams[peer] = Some(stream);
                    expected -= 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (me + 1..n)
                        .filter(|p| streams[*p].is_none())
                        .map(|p| members[p])
                        .collect();
                    return Err(CommError::RendezvousTimeout {
                        rank,
                        missing,
                        timeout: options.rendezvous_timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io("accepting peer connections".into(), e)),
        }
    }
    Ok(streams)
}

/// Reads a peer's greeting; `None` for anything that is not a member presenting the secret.
fn read_hello(stream: &mut TcpStream, secret: &[u8], n: usize) -> Option<usize> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = [0u8; 16];
    stream.read_exact(&mut head).ok()?;
    if &head[..8] != HELLO_MAGIC {
        return None;
    }
    let peer = u32::from_le_bytes(head[8..12].try_into().ok()?) as usize;
    let len = u32::from_le_bytes(head[12..16].try_into().ok()?) as usize;
    if len != secret.len() || peer >= n {
        return None;
    }
    let mut presented = vec![0u8; len];
    stream.read_exact(&mut presented).ok()?;
    stream.set_read_timeout(None).ok()?;
    constant_time_eq(&presented, secret).then_some(peer)
}
