//! Resume, not restart (issue 28): a CPU job that checkpoints every 10 steps
//! (`spec.checkpoint.everySteps`) loses its trainer's worker mid-run; the coordinator has been
//! writing the newest checkpoint into `status.checkpoint`, the operator fixes it as the new
//! epoch's `status.resumedFrom`, and the new gang starts from that checkpoint's version and runs
//! only the steps after it — at most `everySteps` of them again — to Succeeded. Without
//! KUBECONFIG the test prints that it skipped and passes (CI makes that an error).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use rlplane_api::{CheckpointRef, Phase, RLJob};
use rlplane_e2e::jobs::{Cluster, Runner};
use rlplane_e2e::{epoch_of, kubectl, phase_of};
use rlplane_operator::desired::WORKER_CONTAINER;

/// Enough that the kill lands long before the job could end on its own.
const STEPS: u64 = 400;
const EVERY: u64 = 10;

fn checkpoint(j: &RLJob) -> Option<CheckpointRef> {
    j.status.as_ref().and_then(|s| s.checkpoint.clone())
}

#[tokio::test]
async fn a_gang_restart_resumes_after_the_last_checkpoint_instead_of_starting_over() -> anyhow::Result<()> {
    let Some(c) = Cluster::start("resume").await? else { return Ok(()) };
    let name = c.apply("rljob-cpu.yaml", |t| {
        let t = t.replace("steps: 3", &format!("steps: {STEPS}"));
        format!("{}\n  checkpoint:\n    everySteps: {EVERY}\n", t.trim_end())
    })?;
    let job = c.wait(&name, "a second checkpoint", |j| checkpoint(j).is_some_and(|cp| cp.step >= 2 * EVERY)).await?;
    let cp = checkpoint(&job).context("a checkpoint")?;
    println!("status.checkpoint: step {}, {}", cp.step, cp.uri);
    assert_eq!(cp.step % EVERY, 0, "checkpoints come every {EVERY} steps: {cp:?}");
    assert!(cp.uri.starts_with("synthetic:"), "the synthetic trainer's checkpoint: {cp:?}");

    let victim = format!("{name}-trainer-0");
    c.kill_worker(&victim).await?;
    let killed_at = job.status.as_ref().and_then(|s| s.step).unwrap_or(0);
    println!("killed the worker of {victim} (SIGKILL) near step {killed_at}");

    let job = c.wait(&name, "a gang restart", |j| epoch_of(j) == 1).await?;
    let st = job.status.clone().unwrap_or_default();
    let resumed = st.resumed_from.clone().context("status.resumedFrom after the restart")?;
    println!("epoch 1 resumes from step {}: {}", resumed.step, resumed.uri);
    assert!(resumed.step >= cp.step && resumed.step % EVERY == 0, "{resumed:?} after {cp:?}");

    // The new coordinator loaded the checkpoint's version as its initial weights (its log says
    // so; on the real node, where the whole log is at hand).
    if matches!(c.runner, Runner::RealNode(_)) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let line = loop {
            // The pod of epoch 1 (its name is the same as the killed one's).
            let selector = format!("rlplane.dev/job={name},rlplane.dev/epoch=1,rlplane.dev/role=trainer");
            let (_, log, _) =
                kubectl(&["logs", "-n", &c.env.namespace, "-l", &selector, "-c", WORKER_CONTAINER, "--tail=-1"])?;
            if let Some(l) = log.lines().find(|l| l.contains("initial weights loaded everywhere")) {
                break l.trim().to_string();
            }
            anyhow::ensure!(Instant::now() < deadline, "epoch 1's coordinator never loaded its weights:\n{log}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        println!("epoch 1's coordinator: {line}");
        assert!(line.contains(&format!("version={}", resumed.step)), "{line}");
    }

    // The new epoch's steps: from the one after the checkpoint to the last.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(240);
    let done = loop {
        let j = c.env.jobs().get(&name).await?;
        if epoch_of(&j) == 1
            && let Some(s) = j.status.as_ref().and_then(|s| s.step)
            && seen.last() != Some(&s)
        {
            seen.push(s);
        }
        if matches!(phase_of(&j), Some(Phase::Succeeded | Phase::Failed)) || Instant::now() > deadline {
            break j;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let st = done.status.clone().unwrap_or_default();
    println!("epoch 1 reported steps {seen:?}; {:?} after {} restart(s)", phase_of(&done), st.restarts);
    assert_eq!(phase_of(&done), Some(Phase::Succeeded), "{st:?}");
    assert_eq!((st.epoch, st.restarts, st.step), (1, 1, Some(STEPS)), "{st:?}");
    // Epoch 0's last report may show until the new coordinator's first; from then on only steps
    // after the checkpoint (an epoch starting over would show steps below it for seconds).
    assert!(seen.iter().all(|&s| s >= resumed.step), "epoch 1 reported a step before {resumed:?}: {seen:?}");
    let redone = killed_at.saturating_sub(resumed.step);
    println!("steps run again: {redone} (at most everySteps = {EVERY}, plus those done while the kill landed)");
    let last = checkpoint(&done).context("the last checkpoint")?;
    assert_eq!(last.step, STEPS, "the synthetic trainer checkpoints the last step too: {last:?}");
    c.env.cleanup().await
}
