//! Page releases reach the executor in order with the page reads and writes around them, on both
//! runners: a read issued before a release sees the KV, one issued after sees the poison, and a
//! write after the release replaces the poison.

use lockstep_core::kv::PoolConfig;
use lockstep_core::model::ProvenanceModel;

use super::*;

fn model() -> ProvenanceModel {
    ProvenanceModel::new(PoolConfig { pages_total: 2, page_tokens: 2, pins_max: 0 }, 1, 97)
}

/// Write page 0, read it, release it, read it, write it again, read it: the three reads' bytes.
async fn reads_around_a_release<R: PageRunner>(runner: &mut R) -> Vec<Vec<u8>> {
    let kv: Vec<u8> = (1..=16).collect();
    runner.write_page(0, kv.clone()).unwrap();
    runner.read_page(0, 0);
    runner.release_pages(vec![0]);
    runner.read_page(1, 0);
    runner.write_page(0, kv).unwrap();
    runner.read_page(2, 0);
    let mut reads = Vec::new();
    for tag in 0..3 {
        match runner.step_or_read().await {
            StepOrRead::Read((t, bytes)) => {
                assert_eq!(t, tag, "reads come back in issue order");
                reads.push(bytes.unwrap());
            }
            StepOrRead::Step(s) => panic!("no step was launched, got {s:?}"),
        }
    }
    reads
}

fn assert_in_order(reads: &[Vec<u8>]) {
    let kv: Vec<u8> = (1..=16).collect();
    assert_eq!(reads[0], kv, "the read before the release sees the KV");
    assert_ne!(reads[1], kv, "the read after it sees poison");
    assert_eq!(reads[2], kv, "a write after the release replaces the poison");
}

#[tokio::test]
async fn the_inline_runner_releases_at_once() {
    let mut runner = InlineRunner::new(model(), StepCost::ZERO);
    assert_in_order(&reads_around_a_release(&mut runner).await);
}

#[tokio::test]
async fn the_thread_runner_releases_in_queue_order() {
    let mut runner = ThreadRunner::spawn_with_pages(model(), 8).unwrap();
    assert_in_order(&reads_around_a_release(&mut runner).await);
}

#[tokio::test]
async fn releases_take_no_place_in_the_thread_runners_queue_and_stay_bounded() {
    // Thousands of releases with no job between, on a queue of one job: they ride with the next
    // job instead of filling the queue, and repeating a page does not grow what waits.
    let mut runner = ThreadRunner::spawn_with_pages(model(), 1).unwrap();
    for _ in 0..5_000 {
        runner.release_pages(vec![0, 1]);
    }
    assert!(runner.released.len() <= 2 * RELEASED_DEDUP_MIN, "{}", runner.released.len());
    runner.read_page(7, 1);
    match runner.step_or_read().await {
        StepOrRead::Read((7, bytes)) => assert_ne!(bytes.unwrap(), vec![0; 16], "poisoned"),
        other => panic!("{other:?}"),
    }
}
