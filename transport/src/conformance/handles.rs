//! The handle rules: handles (and errors) are plain serializable data; a handle the reader cannot
//! use is a typed error; a handle to a dropped region is `UnknownRegion`; region ids are never
//! reused.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{
    accumulate, must_read_f32, one_of_each, read_f32, register_accumulator, register_inbox,
    register_published, send, ship, tag, Pair, OWNER,
};
use crate::{codec, Descriptor, Dtype, Op, RegionHandle, TransportError, WriteTag};

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    backend: &str,
    value: &T,
) {
    let back = serde_json::to_vec(value)
        .map_err(|e| e.to_string())
        .and_then(|wire| serde_json::from_slice::<T>(&wire).map_err(|e| e.to_string()));
    assert_eq!(back.as_ref(), Ok(value), "{backend}: serde_json round trip");
}

/// Handles: the handles of all three region kinds, tags with extreme values, and every kind of
/// error (those the backend produced among them) survive `serde_json` unchanged.
pub async fn handles_round_trip_through_serde_handles(pair: Pair) {
    let b = pair.reader.backend();
    let params = register_published(&pair, Dtype::Bf16, codec::encode(Dtype::Bf16, &[1.0; 3]), 9);
    let acc = register_accumulator(&pair, 5, u64::MAX - 1);
    let inbox = register_inbox(&pair, 6);
    for handle in [params.handle(), acc.handle(), inbox.handle()] {
        assert_eq!(ship(&handle), handle, "{b}: {:?} handle", handle.kind);
    }
    assert_eq!(
        acc.handle().version,
        u64::MAX - 1,
        "{b}: epoch in the handle"
    );
    round_trip(
        b,
        &WriteTag {
            epoch: u64::MAX,
            write_id: u128::MAX,
            token: 0,
        },
    );

    // Errors the backend produced.
    let (p, a, i) = (
        ship(&params.handle()),
        ship(&acc.handle()),
        ship(&inbox.handle()),
    );
    let produced = [
        read_f32(&pair, &p, 2..7).await.0.err(),
        read_f32(&pair, &a, 0..1).await.0.err(),
        accumulate(&pair, &a, 0, &[1.0], tag(3, u128::MAX))
            .await
            .err(),
        send(&pair, &i, tag(5, 1), b"x").await.err(),
    ];
    for error in produced {
        match error {
            Some(error) => round_trip(b, &error),
            None => panic!("{b}: a bad request succeeded"),
        }
    }
    // Every other kind of error.
    let errors = [
        TransportError::UnknownRegion {
            owner: OWNER,
            region: 1,
        },
        TransportError::ForeignHandle {
            owner: OWNER,
            region: 2,
            reason: "elsewhere".into(),
        },
        TransportError::BadPayload {
            region: 3,
            bytes: 5,
            dtype: Dtype::F32,
        },
        TransportError::LengthMismatch {
            region: 4,
            elements: 1,
            len: 2,
        },
        TransportError::BadDestination {
            region: 5,
            expected: 8,
            got: 7,
        },
        TransportError::Unsupported {
            what: "device memory".into(),
        },
        TransportError::DuplicateWrite {
            region: 6,
            epoch: 1,
            write_id: u128::MAX,
        },
        TransportError::DeadlineExceeded {
            owner: OWNER,
            region: 7,
            op: Op::Recv,
        },
        TransportError::Aborted {
            region: 8,
            epoch: 1,
            current: 2,
        },
        TransportError::InboxFull {
            region: 9,
            held: 3,
            capacity: 3,
        },
        TransportError::Unreachable {
            owner: OWNER,
            reason: "gone".into(),
        },
    ];
    for error in &errors {
        round_trip(b, error);
    }
}

/// Handles that name this backend's regions but cannot be used by the reader: for each descriptor
/// variant, one that names another process, paired with whether the reader must say
/// `ForeignHandle` (`true`) or may say `UnknownRegion` (`false`). A new descriptor variant adds its
/// own foreign forms here.
fn foreign_forms(handle: &RegionHandle) -> Vec<(RegionHandle, bool)> {
    match handle.descriptor {
        Descriptor::Local { process, fabric } => {
            let mut other_process = handle.clone();
            other_process.descriptor = Descriptor::Local {
                process: process ^ 0x4000_0000,
                fabric,
            };
            let mut unknown_fabric = handle.clone();
            unknown_fabric.descriptor = Descriptor::Local {
                process,
                fabric: fabric ^ (1 << 62),
            };
            vec![(other_process, true), (unknown_fabric, false)]
        }
        Descriptor::Tcp { ref addr, instance } => {
            let mut other_instance = handle.clone();
            other_instance.descriptor = Descriptor::Tcp {
                addr: addr.clone(),
                instance: instance ^ (1 << 62),
            };
            vec![(other_instance, false)]
        }
        Descriptor::Shm {
            ref host,
            ref job,
            instance,
            ref socket,
            ref segment,
        } => host_local_forms(handle, (host, job, instance), |host, job, instance| {
            Descriptor::Shm {
                host,
                job,
                instance,
                socket: socket.clone(),
                segment: segment.clone(),
            }
        }),
        Descriptor::Rdma {
            ref addr,
            instance,
            ref gid,
            memory,
        } => {
            let mut other_instance = handle.clone();
            other_instance.descriptor = Descriptor::Rdma {
                addr: addr.clone(),
                instance: instance ^ (1 << 62),
                gid: gid.clone(),
                memory,
            };
            vec![(other_instance, false)]
        }
        Descriptor::Cuda {
            ref host,
            ref job,
            pid,
            instance,
            ref socket,
            device,
            ref memory,
        } => host_local_forms(handle, (host, job, instance), |host, job, instance| {
            Descriptor::Cuda {
                host,
                job,
                pid,
                instance,
                socket: socket.clone(),
                device,
                memory: memory.clone(),
            }
        }),
    }
}

/// The foreign forms of a handle of a host-local backend (`shm`, `cuda`) issued on `host` for
/// `job` by transport `instance`: another host's and another job's (`ForeignHandle`), and another
/// instance's (may be `UnknownRegion`); `descriptor` makes the descriptor of each.
fn host_local_forms(
    handle: &RegionHandle,
    (host, job, instance): (&str, &str, u64),
    descriptor: impl Fn(String, String, u64) -> Descriptor,
) -> Vec<(RegionHandle, bool)> {
    let form = |host: String, job: String, instance: u64| RegionHandle {
        descriptor: descriptor(host, job, instance),
        ..handle.clone()
    };
    vec![
        (
            form(format!("{host}-elsewhere"), job.into(), instance),
            true,
        ),
        (form(host.into(), format!("{job}-other"), instance), true),
        (form(host.into(), job.into(), instance ^ (1 << 62)), false),
    ]
}

fn assert_unusable(
    backend: &str,
    what: &str,
    handle: &RegionHandle,
    foreign: bool,
    got: TransportError,
) {
    let ok = match &got {
        TransportError::ForeignHandle {
            owner,
            region,
            reason,
        } => *owner == OWNER && *region == handle.id && !reason.is_empty(),
        TransportError::UnknownRegion { owner, region } => {
            !foreign && *owner == OWNER && *region == handle.id
        }
        _ => false,
    };
    assert!(
        ok,
        "{backend}: {what} through a handle of {:?}: expected {} naming region {} at endpoint \
         {OWNER}, got {got:?}",
        handle.descriptor,
        if foreign {
            "ForeignHandle"
        } else {
            "ForeignHandle or UnknownRegion"
        },
        handle.id
    );
}

/// Handles: a handle naming another process (or an unknown part of this backend's namespace) is
/// refused with a typed error naming the region, for reads, accumulates and sends, and changes
/// nothing; a handle with another owner is `UnknownRegion`.
pub async fn foreign_handle_is_refused_handles(pair: Pair) {
    let b = pair.reader.backend();
    let ((_published, acc, inbox), [p, a, i]) =
        one_of_each(&pair, Dtype::F32, codec::encode_f32(&[1.0, 2.0]), 1, 2);

    for (handle, foreign) in foreign_forms(&p) {
        let (result, _) = read_f32(&pair, &handle, 0..2).await;
        match result {
            Ok(_) => panic!("{b}: read through {:?} succeeded", handle.descriptor),
            Err(e) => assert_unusable(b, "read", &handle, foreign, e),
        }
    }
    for (handle, foreign) in foreign_forms(&a) {
        match accumulate(&pair, &handle, 0, &[1.0, 1.0], tag(0, 1)).await {
            Ok(()) => panic!("{b}: accumulate through {:?} succeeded", handle.descriptor),
            Err(e) => assert_unusable(b, "accumulate", &handle, foreign, e),
        }
    }
    for (handle, foreign) in foreign_forms(&i) {
        match send(&pair, &handle, tag(0, 1), b"x").await {
            Ok(()) => panic!("{b}: send through {:?} succeeded", handle.descriptor),
            Err(e) => assert_unusable(b, "send", &handle, foreign, e),
        }
    }
    let mut other_owner = p.clone();
    other_owner.owner = OWNER + 1;
    assert_eq!(
        read_f32(&pair, &other_owner, 0..2).await.0,
        Err(TransportError::UnknownRegion {
            owner: OWNER + 1,
            region: p.id
        }),
        "{b}: a handle naming another owner"
    );

    // Nothing changed: write id 1 and message id 1 are free, the accumulator holds nothing.
    super::must_accumulate(&pair, &a, 0, &[0.5, 0.5], tag(0, 1)).await;
    assert_eq!(
        acc.take(1),
        [0.5, 0.5],
        "{b}: only the usable handle's write"
    );
    super::must_send(&pair, &i, tag(0, 1), b"usable").await;
    assert_eq!(
        &super::must_recv(b, inbox.as_ref(), tag(0, 1)).await[..],
        b"usable"
    );
}

/// Handles: once the owner drops a region's guard, reads, accumulates and sends through a handle
/// to it are `UnknownRegion` naming owner and region.
pub async fn dropped_region_is_unknown_handles(pair: Pair) {
    let b = pair.reader.backend();
    let params = register_published(&pair, Dtype::F32, codec::encode_f32(&[1.0; 4]), 1);
    let acc = register_accumulator(&pair, 4, 0);
    let inbox = register_inbox(&pair, 0);
    let (p, a, i) = (
        ship(&params.handle()),
        ship(&acc.handle()),
        ship(&inbox.handle()),
    );
    must_read_f32(&pair, &p, 0..4).await;
    super::must_accumulate(&pair, &a, 0, &[1.0; 4], tag(0, 1)).await;
    super::must_send(&pair, &i, tag(0, 1), b"x").await;
    drop(params);
    drop(acc);
    drop(inbox);
    let unknown = |handle: &RegionHandle| TransportError::UnknownRegion {
        owner: OWNER,
        region: handle.id,
    };
    assert_eq!(
        read_f32(&pair, &p, 0..4).await.0,
        Err(unknown(&p)),
        "{b}: read after the region was dropped"
    );
    assert_eq!(
        accumulate(&pair, &a, 0, &[1.0; 4], tag(0, 2)).await,
        Err(unknown(&a)),
        "{b}: accumulate after the region was dropped"
    );
    assert_eq!(
        send(&pair, &i, tag(0, 2), b"x").await,
        Err(unknown(&i)),
        "{b}: send after the region was dropped"
    );
}

/// Handles: every registration gets its own region id, each handle reaches its own region, and a
/// region registered after another was dropped never takes its id (the stale handle stays
/// unknown instead of reaching the new region).
pub async fn region_ids_are_never_reused_handles(pair: Pair) {
    let b = pair.reader.backend();
    let params: Vec<_> = (0..4)
        .map(|i| register_published(&pair, Dtype::F32, codec::encode_f32(&[i as f32]), i))
        .collect();
    let accs: Vec<_> = (0..4).map(|_| register_accumulator(&pair, 1, 0)).collect();
    let inboxes: Vec<_> = (0..4).map(|_| register_inbox(&pair, 0)).collect();
    let mut ids: Vec<_> = params
        .iter()
        .map(|r| r.handle().id)
        .chain(accs.iter().map(|r| r.handle().id))
        .chain(inboxes.iter().map(|r| r.handle().id))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 12, "{b}: 12 registrations, distinct ids");
    for (i, region) in params.iter().enumerate() {
        let (version, got) = must_read_f32(&pair, &ship(&region.handle()), 0..1).await;
        assert_eq!(
            (version, got),
            (i as u64, vec![i as f32]),
            "{b}: region {i} reads its own contents"
        );
    }

    let mut stale = Vec::new();
    for region in params {
        stale.push(ship(&region.handle()));
    }
    // All four dropped; register as many again.
    let fresh: Vec<_> = (0..4)
        .map(|i| {
            register_published(
                &pair,
                Dtype::F32,
                codec::encode_f32(&[100.0 + i as f32]),
                50,
            )
        })
        .collect();
    for region in &fresh {
        let id = region.handle().id;
        assert!(!ids.contains(&id), "{b}: region id {id} was reused");
    }
    for handle in &stale {
        assert_eq!(
            read_f32(&pair, handle, 0..1).await.0,
            Err(TransportError::UnknownRegion {
                owner: OWNER,
                region: handle.id
            }),
            "{b}: a handle to a dropped region after new registrations"
        );
    }
    drop((accs, inboxes, fresh));
}
