//! The links' lent sends and posted receives against a raw peer socket this test drives.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::*;

/// Rank 0's links to a peer (rank 1) whose socket the test holds.
fn links_and_peer() -> (Links, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (peer, _) = listener.accept().unwrap();
    (Links::start(vec![None, Some(ours)], "test").unwrap(), peer)
}

fn data_header(part: u32, len: usize) -> Header {
    Header {
        kind: KIND_DATA,
        op: 2,
        dtype: 1,
        reduce: 0,
        step: 0,
        part,
        seq: 7,
        count: 99,
        len: len as u64,
    }
}

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn a_posted_receive_lands_in_place_and_an_earlier_frame_arrives_as_bytes() {
    let (links, mut peer) = links_and_peer();
    // Part 0 is sent before anything is posted for it; part 1 after its posting.
    peer.write_all(&data_header(0, 3).encode()).unwrap();
    peer.write_all(b"abc").unwrap();
    let first = links.inbox.recv(1, WAIT).ok().unwrap();
    assert!(matches!(first.payload, Payload::Bytes(ref b) if b.as_slice() == b"abc"));

    let mut dst = vec![0u8; 5];
    // SAFETY: `dst` is left alone until the frame lands (checked below) or is withdrawn.
    let id = unsafe { links.inbox.post(1, data_header(1, 5), dst.as_mut_ptr()) };
    // A frame of another length is not the posted one: it arrives as bytes.
    peer.write_all(&data_header(1, 4).encode()).unwrap();
    peer.write_all(b"wxyz").unwrap();
    let other = links.inbox.recv(1, WAIT).ok().unwrap();
    assert!(matches!(other.payload, Payload::Bytes(ref b) if b.as_slice() == b"wxyz"));
    peer.write_all(&data_header(1, 5).encode()).unwrap();
    peer.write_all(b"hello").unwrap();
    let landed = links.inbox.recv(1, WAIT).ok().unwrap();
    assert!(matches!(landed.payload, Payload::Landed));
    assert_eq!(landed.header, data_header(1, 5));
    assert!(links.inbox.withdraw(1, id, None));
    assert_eq!(dst, b"hello");
}

#[test]
fn a_withdrawn_posting_is_not_written_and_a_write_stalled_mid_frame_ends_when_cut() {
    let (links, mut peer) = links_and_peer();
    let mut dst = vec![0u8; 8];
    // SAFETY: as above.
    let id = unsafe { links.inbox.post(1, data_header(0, 8), dst.as_mut_ptr()) };
    assert!(links.inbox.withdraw(1, id, Some(Instant::now())));
    peer.write_all(&data_header(0, 8).encode()).unwrap();
    peer.write_all(b"12345678").unwrap();
    let frame = links.inbox.recv(1, WAIT).ok().unwrap();
    assert!(matches!(frame.payload, Payload::Bytes(_)));
    assert_eq!(dst, [0; 8], "a withdrawn posting was written");

    // The peer sends half a frame and stops: the reader is writing into the posting, so
    // withdrawing it waits until the deadline, and after a cut it returns at once.
    // SAFETY: as above.
    let id = unsafe { links.inbox.post(1, data_header(1, 8), dst.as_mut_ptr()) };
    peer.write_all(&data_header(1, 8).encode()).unwrap();
    peer.write_all(b"half").unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let began = Instant::now();
    assert!(
        !links
            .inbox
            .withdraw(1, id, Some(began + Duration::from_millis(200)))
    );
    assert!(began.elapsed() >= Duration::from_millis(200));
    links.cut(1);
    assert!(links.inbox.withdraw(1, id, None));
    assert!(began.elapsed() < Duration::from_secs(5));
    assert!(matches!(links.inbox.recv(1, WAIT), Err(RecvFailure::Lost)));
}

#[test]
fn lent_payloads_are_returned_written_or_when_a_peer_that_stopped_reading_is_cut() {
    let (links, mut peer) = links_and_peer();
    let payload: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
    let leases = Leases::new(2);
    // SAFETY: `payload` outlives the waits below and is not written.
    assert!(unsafe { links.send_lent(1, data_header(0, 3000), &payload, leases.lend(1)) });
    assert_eq!(leases.wait(Some(Instant::now() + WAIT)), Ok(None));
    let mut got = vec![0u8; HEADER_BYTES + 3000];
    peer.read_exact(&mut got).unwrap();
    assert_eq!(
        Header::decode(got[..HEADER_BYTES].try_into().unwrap()),
        Some(data_header(0, 3000))
    );
    assert_eq!(&got[HEADER_BYTES..], &payload[..]);

    // 64 MiB to a peer that reads nothing fills the sockets' buffers: the lease is still out
    // at the deadline, named by its peer; cutting the link returns it, as unsent.
    let big = vec![1u8; 64 << 20];
    let leases = Leases::new(2);
    // SAFETY: as above.
    assert!(unsafe { links.send_lent(1, data_header(1, big.len()), &big, leases.lend(1)) });
    let began = Instant::now();
    assert_eq!(
        leases.wait(Some(began + Duration::from_millis(300))),
        Err(1)
    );
    links.cut(1);
    assert_eq!(leases.wait(None), Ok(Some(1)));
    assert!(began.elapsed() < Duration::from_secs(5));
    drop(peer);
}
