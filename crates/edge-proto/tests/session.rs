//! Protocol scenarios: a client and a server session over the in-memory [`Pair`] link.
//!
//! Every test is deterministic: virtual time, and a link RNG seeded from the test's name.

mod util;

use std::collections::HashMap;
use std::time::Duration;

use edge_proto::client::ClientEvent;
use edge_proto::server::ServerEvent;
use edge_proto::{
    AckStatus, ChunkHeader, Codec, ControlFrame, ErrorCode, FRAME_HEADER_LEN, Limits, ProtoError, RejectReason,
    RetryReason, StreamName, VERSION,
};
use util::{Failure, Pair, PairConfig};

fn name(s: &str) -> StreamName {
    StreamName::new(s).expect("test names are valid")
}

fn encode(frame: &ControlFrame) -> Vec<u8> {
    let mut out = Vec::new();
    frame.encode(&mut out);
    out
}

fn connected_pair(test: &str, config: PairConfig) -> Pair {
    let mut pair = Pair::with_config(test, config);
    pair.drive();
    assert!(pair.client.is_connected(), "handshake failed: {:?}", pair.client_failure);
    pair
}

#[test]
fn handshake_completes_in_one_round_trip() {
    let mut pair = Pair::new(test_name!());
    pair.drive();

    assert!(pair.client.is_connected() && pair.server.is_established());
    assert!(pair.client.can_open_chunk());
    assert_eq!(pair.server.spool_id(), Some([0x5a; 16]));
    let (at, ev) = &pair.server_events[0];
    assert_eq!(
        *ev,
        ServerEvent::Hello {
            spool_id: [0x5a; 16],
            agent: "edge-uploader/test pair".into(),
            version: edge_proto::VERSION
        }
    );
    assert_eq!(*at - pair.start, pair.latency);
    let (at, ev) = &pair.client_events[0];
    assert_eq!(
        *ev,
        ClientEvent::Connected {
            device: "device-under-test".into(),
            max_chunk_payload: Limits::default().max_chunk_payload,
            max_in_flight: 64,
        }
    );
    assert_eq!(*at - pair.start, 2 * pair.latency);
    // No timers are left once both sides are through the handshake.
    assert_eq!(pair.client.poll_timeout(), None);
    assert_eq!(pair.server.poll_timeout(), None);
    assert_eq!((pair.client_failure.clone(), pair.server_failure.clone()), (None, None));
}

#[test]
fn thousand_chunks_on_three_streams_are_each_acked_exactly_once_out_of_order() {
    let mut pair = connected_pair(test_name!(), PairConfig { max_in_flight: 48, ..PairConfig::default() });
    let streams = [name("temp"), name("humidity"), name("door.events")];
    let mut sent = Vec::new();
    let mut next_seq = [0u64; 3];

    for _round in 0..10_000 {
        while sent.len() < 1000 && pair.client.can_open_chunk() {
            let s = pair.random_range(0..3);
            let seq = next_seq[s];
            next_seq[s] += 1;
            pair.send_chunk(&streams[s], seq).expect("window has room");
            sent.push((streams[s].clone(), seq));
        }
        pair.drive();
        if sent.len() == 1000 && pair.client.in_flight() == 0 {
            break;
        }
        // The sink finishes a random part of what is pending, in random order.
        let pending = pair.accepted.len();
        let n = pair.random_range(1..pending.max(1) + 1);
        pair.ack_some(n, |_| AckStatus::Stored);
        pair.drive();
    }

    assert_eq!((pair.client_failure.clone(), pair.server_failure.clone()), (None, None));
    let acks = pair.client_acks();
    let mut count: HashMap<(StreamName, u64), usize> = HashMap::new();
    for (stream, seq, status) in &acks {
        assert_eq!(*status, AckStatus::Stored);
        *count.entry((stream.clone(), *seq)).or_default() += 1;
    }
    assert_eq!(sent.len(), 1000);
    assert_eq!(count.len(), 1000, "every chunk acked");
    assert!(count.values().all(|&c| c == 1), "no chunk acked twice");
    assert!(sent.iter().all(|k| count.contains_key(k)));
    let ack_order: Vec<_> = acks.iter().map(|(s, q, _)| (s.clone(), *q)).collect();
    assert_ne!(ack_order, sent, "acks arrive in another order than the sends");
    assert!(next_seq.iter().all(|&n| n > 0), "all three streams used");
    assert_eq!(pair.client.in_flight(), 0);
    assert_eq!(pair.server.in_flight(), 0);
}

#[test]
fn retry_and_rejected_statuses_surface_to_the_client() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    let s = name("metrics");
    pair.send_chunk(&s, 1).expect("room");
    pair.send_chunk(&s, 2).expect("room");
    // A chunk whose payload was corrupted in the agent's spool: the checksum cannot match.
    let payload = b"\x03\0\0\0abc".to_vec();
    let header = ChunkHeader {
        stream: s.clone(),
        seq: 3,
        records: 1,
        raw_len: 7,
        payload_len: 7,
        codec: Codec::None,
        checksum: edge_proto::crc32c(&payload) ^ 1,
        created_ms: 0,
    };
    pair.send_raw_chunk(&header, &payload).expect("room");
    pair.drive();

    pair.ack_all(|h| match h.seq {
        1 => AckStatus::Retry(RetryReason::SinkUnavailable),
        _ => AckStatus::Rejected(RejectReason::BadRecords),
    });
    pair.drive();

    let mut acks = pair.client_acks();
    acks.sort_by_key(|(_, seq, _)| *seq);
    assert_eq!(
        acks,
        vec![
            (s.clone(), 1, AckStatus::Retry(RetryReason::SinkUnavailable)),
            (s.clone(), 2, AckStatus::Rejected(RejectReason::BadRecords)),
            (s.clone(), 3, AckStatus::Rejected(RejectReason::BadChecksum)),
        ]
    );
    // A retried chunk may be sent again on the same connection.
    pair.send_chunk(&s, 1).expect("retry resend");
    pair.drive();
    pair.ack_all(|_| AckStatus::Duplicate);
    pair.drive();
    assert_eq!(pair.client_acks().last(), Some(&(s, 1, AckStatus::Duplicate)));
    assert_eq!(pair.client_failure, None);
}

#[test]
fn version_mismatch_closes_with_unsupported_version() {
    let mut pair = Pair::new(test_name!());
    // Replace the client's Hello with one from a future version.
    pair.client.poll_transmit().expect("Hello is queued");
    let hello = ControlFrame::Hello { version: VERSION + 1, spool_id: [1; 16], agent: "future".into() };
    pair.inject_control_to_server(encode(&hello));
    pair.drive();

    assert_eq!(pair.server_failure, Some(Failure::Local(ProtoError::UnsupportedVersion { version: VERSION + 1 })));
    assert_eq!(pair.client_failure, Some(Failure::Peer(ErrorCode::UnsupportedVersion)));
    assert!(pair.server_events.is_empty(), "no Hello event");
    assert!(pair.client_events.is_empty(), "no Welcome was sent");
}

#[test]
fn a_chunk_before_hello_closes_with_protocol_violation() {
    let mut pair = Pair::new(test_name!());
    let payload = Vec::new();
    let header = ChunkHeader {
        stream: name("early"),
        seq: 0,
        records: 0,
        raw_len: 0,
        payload_len: 0,
        codec: Codec::None,
        checksum: edge_proto::crc32c(&payload),
        created_ms: 0,
    };
    let mut bytes = Vec::new();
    header.encode(&mut bytes);
    // The chunk stream overtakes the control stream carrying the Hello.
    pair.inject_chunk_stream(bytes, pair.latency / 2);
    pair.drive();

    let Some(Failure::Local(err)) = pair.server_failure.clone() else {
        panic!("server did not fail: {:?}", pair.server_failure)
    };
    assert_eq!(err, ProtoError::ChunkBeforeHello { stream: name("early"), seq: 0 });
    assert_eq!(err.code(), ErrorCode::ProtocolViolation);
    assert_eq!(pair.client_failure, Some(Failure::Peer(ErrorCode::ProtocolViolation)));
}

#[test]
fn an_oversized_declared_control_frame_is_refused_without_buffering_it() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    // An Ack header declaring a 2 GiB body, followed by a first megabyte of it.
    let mut bytes = vec![0x03];
    bytes.extend_from_slice(&(1u32 << 31).to_le_bytes());
    bytes.extend(std::iter::repeat_n(0u8, 1 << 20));
    pair.inject_control_to_client(bytes);
    pair.drive();

    let max = u64::from(Limits::default().max_control_frame);
    assert_eq!(pair.client_failure, Some(Failure::Local(ProtoError::FrameTooLarge { len: 1 << 31, max })));
    assert_eq!(pair.server_failure, Some(Failure::Peer(ErrorCode::FrameTooLarge)));
    assert_eq!(pair.client.buffered_len(), 0, "nothing of the declared body was kept");
}

#[test]
fn an_oversized_control_frame_from_the_agent_is_refused_from_its_header() {
    let mut pair = Pair::new(test_name!());
    pair.client.poll_transmit().expect("Hello is queued");
    let mut bytes = vec![0x01];
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    bytes.extend_from_slice(&[0u8; 4096]);
    pair.inject_control_to_server(bytes);
    pair.drive();

    let Some(Failure::Local(err)) = pair.server_failure.clone() else {
        panic!("server did not fail: {:?}", pair.server_failure)
    };
    assert_eq!(err.code(), ErrorCode::FrameTooLarge);
    assert!(pair.server.buffered_len() <= FRAME_HEADER_LEN);
}

#[test]
fn handshake_times_out_on_both_sides_when_the_path_is_black_holed() {
    let mut pair = Pair::new(test_name!());
    pair.drop_to_server = true;
    pair.drop_to_client = true;
    pair.drive();

    assert_eq!(pair.client_failure, Some(Failure::Local(ProtoError::HandshakeTimeout)));
    assert_eq!(pair.server_failure, Some(Failure::Local(ProtoError::HandshakeTimeout)));
    assert_eq!(pair.client_failed_after, Some(Limits::default().handshake_timeout));
    assert_eq!(pair.server_failed_after, Some(Limits::default().handshake_timeout));
    assert_eq!(pair.client.close_code(), Some(ErrorCode::HandshakeTimeout));
    assert_eq!(pair.server.close_code(), Some(ErrorCode::HandshakeTimeout));
}

#[test]
fn client_times_out_when_the_welcome_is_lost() {
    let limits = Limits { handshake_timeout: Duration::from_secs(3), ..Limits::default() };
    let mut pair = Pair::with_config(test_name!(), PairConfig { limits, ..PairConfig::default() });
    pair.drop_to_client = true;
    pair.drive();

    assert!(pair.server.is_established(), "the server saw the Hello in time");
    assert_eq!(pair.client_failure, Some(Failure::Local(ProtoError::HandshakeTimeout)));
    assert_eq!(pair.server_failure, Some(Failure::Peer(ErrorCode::HandshakeTimeout)));
    assert_eq!(pair.client_failed_after, Some(Duration::from_secs(3)));
    let close_arrived = Duration::from_secs(3) + pair.latency;
    assert_eq!(pair.server_failed_after, Some(close_arrived), "the close takes one latency");
}

#[test]
fn server_times_out_when_no_hello_arrives() {
    let limits = Limits { handshake_timeout: Duration::from_secs(5), ..Limits::default() };
    let mut pair = Pair::with_config(test_name!(), PairConfig { limits, ..PairConfig::default() });
    pair.client.poll_transmit().expect("Hello is queued"); // The agent never sends it.
    pair.drive();

    assert_eq!(pair.server_failure, Some(Failure::Local(ProtoError::HandshakeTimeout)));
    // Both sessions started at the same instant, so the client's own deadline fires with it.
    assert_eq!(pair.client_failure, Some(Failure::Local(ProtoError::HandshakeTimeout)));
    assert_eq!(pair.server_failed_after, Some(Duration::from_secs(5)));
    assert_eq!(pair.client_failed_after, Some(Duration::from_secs(5)));
}

#[test]
fn an_ack_for_an_unknown_chunk_closes_with_protocol_violation() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    pair.send_chunk(&name("real"), 1).expect("room");
    let bogus = ControlFrame::Ack { stream: name("real"), seq: 2, status: AckStatus::Stored };
    pair.inject_control_to_client(encode(&bogus));
    pair.drive();

    assert_eq!(pair.client_failure, Some(Failure::Local(ProtoError::UnknownChunk { stream: name("real"), seq: 2 })));
    assert_eq!(pair.server_failure, Some(Failure::Peer(ErrorCode::ProtocolViolation)));
    assert!(pair.client_acks().is_empty());
}

#[test]
fn go_away_stops_new_chunks_while_in_flight_acks_still_arrive() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    let s = name("logs");
    for seq in 0..10 {
        pair.send_chunk(&s, seq).expect("room");
    }
    pair.drive();
    assert_eq!(pair.accepted.len(), 10);

    pair.server.go_away(ErrorCode::ShuttingDown);
    pair.ack_some(3, |_| AckStatus::Stored);
    pair.drive();
    assert!(pair.client_events.iter().any(|(_, e)| *e == ClientEvent::GoAway { code: ErrorCode::ShuttingDown }));
    assert!(!pair.client.can_open_chunk());
    assert!(pair.client.is_connected(), "GoAway is not a close");
    assert_eq!(pair.client.chunk_sent(&s, 10), Err(ProtoError::Draining { code: ErrorCode::ShuttingDown }));
    assert_eq!(pair.client_acks().len(), 3);
    assert!(!pair.client.is_drained());

    pair.ack_all(|_| AckStatus::Stored);
    pair.drive();
    assert_eq!(pair.client_acks().len(), 10);
    assert!(pair.client.is_drained());
    assert_eq!((pair.client_failure.clone(), pair.server_failure.clone()), (None, None));
}

#[test]
fn chunks_opened_before_the_go_away_arrived_are_still_accepted() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    pair.server.go_away(ErrorCode::ShuttingDown);
    // The agent sends before the GoAway reaches it.
    pair.send_chunk(&name("late"), 1).expect("not yet draining");
    pair.drive();
    assert_eq!(pair.accepted.len(), 1);
    pair.ack_all(|_| AckStatus::Stored);
    pair.drive();
    assert!(pair.client.is_drained());
    assert_eq!(pair.server_failure, None);
}

#[test]
fn a_second_hello_closes_with_protocol_violation() {
    let mut pair = connected_pair(test_name!(), PairConfig::default());
    let hello = ControlFrame::Hello { version: VERSION, spool_id: [0x5a; 16], agent: "again".into() };
    pair.inject_control_to_server(encode(&hello));
    pair.drive();
    let Some(Failure::Local(err)) = pair.server_failure.clone() else {
        panic!("server did not fail: {:?}", pair.server_failure)
    };
    assert_eq!(err.code(), ErrorCode::ProtocolViolation);
    assert_eq!(pair.client_failure, Some(Failure::Peer(ErrorCode::ProtocolViolation)));
}
