//! What the real API server says of the CRD and the manifests, through the real `kubectl` users
//! type: the generated CRD is accepted (its CEL rules within the cost budget), `kubectl explain`
//! prints its field docs, `kubectl get rlj` shows its printer columns, every manifest in
//! `manifests/` passes a server-side dry run, and every one in `manifests/invalid/` is refused by
//! the API server naming the field, or (for rules only the operator checks) accepted and then
//! failed as InvalidSpec with the message its `# expect:` line gives.

use std::path::Path;
use std::time::Duration;

use kube::ResourceExt;
use rlplane_e2e::{Env, condition, kubectl, kubectl_stdin, skip_without_cluster, workspace};
use rlplane_operator::conditions::FAILED;

/// `kubectl` that must succeed; returns its stdout.
fn ok(args: &[&str]) -> anyhow::Result<String> {
    let (success, out, err) = kubectl(args)?;
    anyhow::ensure!(success, "kubectl {} failed:\n{err}{out}", args.join(" "));
    Ok(out)
}

#[tokio::test]
async fn the_crd_is_accepted_explained_and_printed_with_its_columns() -> anyhow::Result<()> {
    if skip_without_cluster()? {
        return Ok(());
    }
    let crd = workspace().join("crds/rljob.yaml");
    // What a user runs: the CRD as shipped, through server-side apply (the API server compiles
    // every CEL rule and refuses the CRD if one exceeds the cost budget).
    ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager",
        "rlplane-tools",
        "-f",
        crd.to_str().unwrap(),
    ])?;
    ok(&["wait", "--for=condition=Established", "--timeout=30s", "crd/rljobs.rlplane.dev"])?;

    let explain = ok(&["explain", "rljob.spec.refit"])?;
    println!("{explain}");
    for field in ["transport", "bufferBytes", "numBuffers", "timeoutSeconds"] {
        assert!(explain.contains(field), "kubectl explain rljob.spec.refit lacks {field}:\n{explain}");
    }
    assert!(explain.contains("DESCRIPTION") && explain.lines().count() > 10, "no field docs:\n{explain}");

    let Some(env) = Env::start("columns").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    env.wait_job(&name, "a phase", Duration::from_secs(60), |j| j.status.is_some()).await?;
    let table = ok(&["get", "rlj", "-n", &env.namespace])?;
    println!("{table}");
    let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "MODE", "PHASE", "STEP", "REFIT", "RESTARTS", "AGE"], "{table}");
    let row = table.lines().find(|l| l.starts_with(&name)).unwrap_or_default();
    assert!(row.contains("Split") && row.contains("Starting"), "{table}");
    env.cleanup().await
}

#[tokio::test]
async fn every_manifest_passes_a_server_side_dry_run() -> anyhow::Result<()> {
    if skip_without_cluster()? {
        return Ok(());
    }
    let Some(env) = Env::start("dry-run").await? else { return Ok(()) };
    let dir = workspace().join("manifests");
    let mut n = 0;
    for path in yaml_files(&dir)? {
        let out = ok(&["apply", "--dry-run=server", "-n", &env.namespace, "-f", path.to_str().unwrap()])?;
        println!("{}: {}", path.display(), out.trim());
        n += 1;
    }
    assert!(n >= 5, "only {n} manifests");
    env.cleanup().await
}

#[tokio::test]
async fn every_invalid_manifest_is_refused_naming_the_field_or_fails_as_invalid_spec() -> anyhow::Result<()> {
    if skip_without_cluster()? {
        return Ok(());
    }
    let Some(env) = Env::start("invalid").await? else { return Ok(()) };
    let (mut refused, mut failed) = (Vec::new(), Vec::new());
    for path in yaml_files(&workspace().join("manifests/invalid"))? {
        let text = std::fs::read_to_string(&path)?;
        let header = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("# {key}: ")))
                .map(str::to_string)
                .ok_or_else(|| anyhow::anyhow!("{}: no `# {key}:` line", path.display()))
        };
        let (expect, crd) = (header("expect")?, header("crd")?);
        // The field the message must name: what precedes the first ": " of the expectation,
        // without list indices (`spec.model.tensors[1].name` → the server says `spec.model.tensors[1].name`
        // or, for list-map keys, `spec.model.tensors[1]`).
        let field = expect.split(": ").next().unwrap_or_default().to_string();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let stem = file.trim_end_matches(".yaml");
        // Jobs the API server accepts live on: each gets its own name (several files share one).
        let name = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name: "))
            .ok_or_else(|| anyhow::anyhow!("{file}: no metadata.name"))?
            .to_string();
        let text =
            if crd == "accepts" { text.replacen(&format!("name: {name}"), &format!("name: {stem}"), 1) } else { text };
        let (success, out, err) = kubectl_stdin(&["apply", "-n", &env.namespace, "-f", "-"], &text)?;
        match crd.as_str() {
            // `pruned`: a schema would prune the unknown field silently, but kubectl asks for strict
            // field validation (its default), so the API server refuses it by name.
            "rejects" | "list-map" | "pruned" => {
                assert!(!success, "{file}: the API server accepted it ({crd} expected): {out}");
                let named = field.contains(' ') || err.contains(field.split('[').next().unwrap_or_default());
                assert!(named, "{file}: the refusal does not name {field}:\n{err}");
                refused.push(format!("{file}: {}", err.trim()));
            }
            "accepts" => {
                assert!(success, "{file}: refused by the API server, but only the operator checks it:\n{err}");
                let job = env
                    .wait_job(stem, "Failed/InvalidSpec", Duration::from_secs(60), |j| {
                        condition(j, FAILED).is_some_and(|c| c.1 == "InvalidSpec")
                    })
                    .await?;
                let message = condition(&job, FAILED).unwrap().2;
                assert!(message.contains(&expect), "{file}: InvalidSpec message {message:?} lacks {expect:?}");
                assert!(env.pods_of(stem).await?.is_empty(), "{file}: an invalid job has no pods");
                failed.push(format!("{file}: {message}"));
            }
            other => anyhow::bail!("{file}: `# crd: {other}` is none of rejects, list-map, pruned, accepts"),
        }
    }
    println!("refused by the API server:\n  {}\nInvalidSpec:\n  {}", refused.join("\n  "), failed.join("\n  "));
    assert!(!refused.is_empty() && !failed.is_empty());
    env.cleanup().await
}

fn yaml_files(dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}
