//! What the injector does to one pod: skip it, deny it (an annotation that
//! would give it a sidecar that cannot start), or add the dedupd sidecar,
//! as a JSON patch of `add` operations only. Pure: no I/O, no clock, so
//! every case is a unit test on a fixture.
//!
//! The patch only adds (never `replace`s a list by its rewritten copy): the
//! API server applies it to the pod as it received it, fields this build's
//! Kubernetes types do not know included, so a rewritten copy could drop
//! them.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use clap::Parser;
use json_patch::{jsonptr::PointerBuf, AddOperation, Patch, PatchOperation};
use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{json, Value};

use crate::{
    config::{one_line_error, ServeArgs},
    telemetry::TraceArgs,
};

/// The label that selects a pod for injection (the webhook's
/// `objectSelector` matches it, so no other pod reaches the injector).
pub const LABEL: &str = "dedupd.io/inject";
/// The label's value that asks for the sidecar.
pub const LABEL_ENABLED: &str = "enabled";
/// The sidecar container's name: a pod with a container of this name
/// already has dedupd and is left alone.
pub const SIDECAR: &str = "dedupd";
/// Where the gRPC Unix socket lives, in the sidecar and the app containers.
pub const SOCKET_DIR: &str = "/var/run/dedupd";
/// The data directory inside the sidecar.
pub const DATA_DIR: &str = "/var/lib/dedupd";
/// Where a store URL Secret is mounted.
pub const SECRET_DIR: &str = "/var/run/secrets/dedupd";
/// Where the Secret of answer-sealing keys is mounted: each of its keys a
/// key file (`--encryption-key-file` reads the directory).
pub const ENCRYPTION_KEY_DIR: &str = "/var/run/secrets/dedupd-encryption";
/// Where the Secret of keys that only open answers is mounted
/// (`--decryption-key-file`).
pub const DECRYPTION_KEY_DIR: &str = "/var/run/secrets/dedupd-decryption";
/// Volumes the injector adds.
pub const SOCKET_VOLUME: &str = "dedupd-socket";
/// The data volume (an `emptyDir`, or the PVC an annotation names).
pub const DATA_VOLUME: &str = "dedupd-data";
/// The store URL Secret's volume.
pub const SECRET_VOLUME: &str = "dedupd-store-url";
/// The answer-sealing keys' volume.
pub const ENCRYPTION_KEY_VOLUME: &str = "dedupd-encryption-keys";
/// The volume of the keys that only open answers.
pub const DECRYPTION_KEY_VOLUME: &str = "dedupd-decryption-keys";
/// Seconds added to the sidecar's shutdown grace for the pod's
/// `terminationGracePeriodSeconds`: the app stops first, then dedupd drains.
pub const GRACE_MARGIN_SECONDS: i64 = 10;

const PREFIX: &str = "dedupd.io/";
const ANNOTATION_STORE: &str = "dedupd.io/store";
const ANNOTATION_STORE_URL_SECRET: &str = "dedupd.io/store-url-secret";
const ANNOTATION_DATA_PVC: &str = "dedupd.io/data-pvc";
const ANNOTATION_ENCRYPTION_KEY_SECRET: &str = "dedupd.io/encryption-key-secret";
const ANNOTATION_DECRYPTION_KEY_SECRET: &str = "dedupd.io/decryption-key-secret";

/// A Secret of keys an annotation mounts, every key of it a key file.
#[derive(Debug)]
struct KeySecret {
    annotation: &'static str,
    flag: &'static str,
    dir: &'static str,
    volume: &'static str,
}

/// The key Secrets, in the order their volumes are added.
const KEY_SECRETS: [KeySecret; 2] = [
    KeySecret {
        annotation: ANNOTATION_ENCRYPTION_KEY_SECRET,
        flag: "encryption-key-file",
        dir: ENCRYPTION_KEY_DIR,
        volume: ENCRYPTION_KEY_VOLUME,
    },
    KeySecret {
        annotation: ANNOTATION_DECRYPTION_KEY_SECRET,
        flag: "decryption-key-file",
        dir: DECRYPTION_KEY_DIR,
        volume: DECRYPTION_KEY_VOLUME,
    },
];
const ANNOTATION_NATIVE: &str = "dedupd.io/native-sidecar";
const ANNOTATION_CPU: &str = "dedupd.io/cpu";
const ANNOTATION_MEMORY: &str = "dedupd.io/memory";
const ANNOTATION_IMAGE: &str = "dedupd.io/image";
const ANNOTATION_OTLP_ENDPOINT: &str = "dedupd.io/otlp-endpoint";
const ANNOTATION_OTLP_PROTOCOL: &str = "dedupd.io/otlp-protocol";

/// Annotations that set one dedupd flag each, checked by the same parser
/// and validation `dedupd serve` runs at start.
const FLAG_ANNOTATIONS: [(&str, &str); 5] = [
    (ANNOTATION_STORE, "store"),
    ("dedupd.io/namespace-retention", "namespace-retention"),
    ("dedupd.io/default-lease-ttl", "default-lease-ttl"),
    ("dedupd.io/sync", "sync"),
    // Comma-separated IDs of sealing keys destroyed on purpose.
    ("dedupd.io/erased-key-id", "erased-key-id"),
];

/// Every annotation the injector reads; any other `dedupd.io/` one is a
/// typo and denies the pod rather than being silently ignored.
pub const ANNOTATIONS: [&str; 16] = [
    LABEL,
    ANNOTATION_STORE,
    ANNOTATION_STORE_URL_SECRET,
    ANNOTATION_ENCRYPTION_KEY_SECRET,
    ANNOTATION_DECRYPTION_KEY_SECRET,
    "dedupd.io/namespace-retention",
    "dedupd.io/default-lease-ttl",
    "dedupd.io/sync",
    "dedupd.io/erased-key-id",
    ANNOTATION_OTLP_ENDPOINT,
    ANNOTATION_OTLP_PROTOCOL,
    ANNOTATION_CPU,
    ANNOTATION_MEMORY,
    ANNOTATION_IMAGE,
    ANNOTATION_DATA_PVC,
    ANNOTATION_NATIVE,
];

/// The injector's defaults, which annotations override per pod.
#[derive(Debug, Clone)]
pub struct SidecarDefaults {
    /// The dedupd image.
    pub image: String,
    /// Inject as a native sidecar (an init container that keeps running).
    pub native_sidecar: bool,
    /// CPU request.
    pub cpu: String,
    /// Memory request.
    pub memory: String,
    /// Memory limit.
    pub memory_limit: String,
    /// The sidecar's `--shutdown-grace`.
    pub shutdown_grace: Duration,
    /// gRPC on the pod's loopback, for apps that prefer TCP to the socket.
    pub grpc_port: u16,
    /// `/metrics`, `/healthz`, `/readyz` on the pod IP, for the kubelet.
    pub ops_port: u16,
}

/// What to do with one pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Admit it unchanged, for this reason.
    Skip(&'static str),
    /// Refuse it: a sidecar with these settings would not start.
    Deny(String),
    /// Admit it with the sidecar added.
    Inject {
        /// The `add` operations.
        patch: Patch,
        /// Told to whoever created the pod (kubectl prints them).
        warnings: Vec<String>,
    },
}

/// Decides what to do with `pod`, as the API server sent it.
pub fn decide(pod: &Pod, defaults: &SidecarDefaults) -> Decision {
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    if labels.get(LABEL).map(String::as_str) != Some(LABEL_ENABLED) {
        return Decision::Skip("the pod is not labelled dedupd.io/inject=enabled");
    }
    match annotations.get(LABEL).map(String::as_str) {
        Some("false") => return Decision::Skip("the pod opts out (dedupd.io/inject: \"false\")"),
        None | Some("true") => {}
        Some(other) => {
            return Decision::Deny(format!(
                "annotation {LABEL}: {other:?} is not one of \"true\", \"false\""
            ))
        }
    }
    let Some(spec) = &pod.spec else {
        return Decision::Skip("the pod has no spec");
    };
    let has_sidecar = all_containers(spec).any(|container| container.name == SIDECAR);
    if has_sidecar {
        return Decision::Skip("the pod already has a dedupd container");
    }
    match PodSettings::read(&annotations, defaults) {
        Ok(settings) => settings.inject(pod, defaults),
        Err(denial) => Decision::Deny(denial),
    }
}

/// One pod's settings: the defaults with its annotations applied, checked.
#[derive(Debug)]
struct PodSettings {
    image: String,
    native_sidecar: bool,
    cpu: String,
    memory: String,
    memory_limit: String,
    data_pvc: Option<String>,
    store_url_secret: Option<(String, String)>,
    /// The key Secrets to mount: [`KEY_SECRETS`]' entries and the Secret
    /// each names.
    key_secrets: Vec<(&'static KeySecret, String)>,
    /// `(flag, value)` pairs, passed to the sidecar as `DEDUPD_*` variables.
    flags: Vec<(&'static str, String)>,
    /// Traces are exported (an OTLP endpoint is annotated): the sidecar
    /// also gets the pod's identity for its spans' resource.
    traces: bool,
}

impl PodSettings {
    fn read(
        annotations: &BTreeMap<String, String>,
        defaults: &SidecarDefaults,
    ) -> Result<PodSettings, String> {
        if let Some(unknown) = annotations
            .keys()
            .find(|key| key.starts_with(PREFIX) && !ANNOTATIONS.contains(&key.as_str()))
        {
            return Err(format!(
                "unknown annotation {unknown}; dedupd reads {}",
                ANNOTATIONS.join(", ")
            ));
        }
        let get = |name: &str| annotations.get(name).map(|value| value.trim().to_owned());
        let mut flags = Vec::new();
        for (annotation, flag) in FLAG_ANNOTATIONS {
            if let Some(value) = get(annotation) {
                check_flags(&[(flag, value.clone())])
                    .map_err(|problem| format!("annotation {annotation}: {problem}"))?;
                flags.push((flag, value));
            }
        }
        let shared_store = matches!(get(ANNOTATION_STORE).as_deref(), Some("postgres" | "redis"));
        let store_url_secret = match (get(ANNOTATION_STORE_URL_SECRET), shared_store) {
            (Some(reference), true) => Some(parse_secret_reference(&reference).map_err(
                |problem| format!("annotation {ANNOTATION_STORE_URL_SECRET}: {problem}"),
            )?),
            (Some(_), false) => {
                return Err(format!(
                    "annotation {ANNOTATION_STORE_URL_SECRET} is for {ANNOTATION_STORE}: postgres or redis (the default store is sled)"
                ))
            }
            (None, true) => {
                return Err(format!(
                    "annotation {ANNOTATION_STORE} names a shared store: add {ANNOTATION_STORE_URL_SECRET}: SECRET/KEY, the Secret key holding its URL"
                ))
            }
            (None, false) => None,
        };
        if store_url_secret.is_some() {
            flags.push(("store-url-file", format!("{SECRET_DIR}/store-url")));
        }
        let mut key_secrets = Vec::new();
        for secret in &KEY_SECRETS {
            match get(secret.annotation) {
                None => {}
                Some(name) if is_dns_subdomain(&name) => {
                    flags.push((secret.flag, secret.dir.to_owned()));
                    key_secrets.push((secret, name));
                }
                Some(name) => {
                    return Err(format!(
                        "annotation {}: {name:?} is not a Secret name (lower-case letters, digits, '-' and '.')",
                        secret.annotation
                    ))
                }
            }
        }
        // Each flag passed alone above; together they must pass too.
        check_flags(&flags).map_err(|problem| format!("dedupd annotations: {problem}"))?;
        let traces =
            read_trace_annotations(get(ANNOTATION_OTLP_ENDPOINT), get(ANNOTATION_OTLP_PROTOCOL))?;
        let traces_on = !traces.is_empty();
        flags.extend(traces);

        let native_sidecar = match get(ANNOTATION_NATIVE).as_deref() {
            None => defaults.native_sidecar,
            Some("true") => true,
            Some("false") => false,
            Some(other) => {
                return Err(format!(
                    "annotation {ANNOTATION_NATIVE}: {other:?} is not one of \"true\", \"false\""
                ))
            }
        };
        let quantity = |annotation: &str, kind: QuantityKind| match get(annotation) {
            None => Ok(None),
            Some(value) if is_quantity(&value, kind) => Ok(Some(value)),
            Some(value) => Err(format!(
                "annotation {annotation}: {value:?} is not a Kubernetes quantity ({})",
                kind.example()
            )),
        };
        let cpu = quantity(ANNOTATION_CPU, QuantityKind::Cpu)?;
        let memory = quantity(ANNOTATION_MEMORY, QuantityKind::Memory)?;
        let image = match get(ANNOTATION_IMAGE) {
            None => defaults.image.clone(),
            Some(image) if is_image_reference(&image) => image,
            Some(image) => {
                return Err(format!(
                    "annotation {ANNOTATION_IMAGE}: {image:?} is not an image reference (e.g. ghcr.io/dedupd/dedupd:0.1.0)"
                ))
            }
        };
        let data_pvc = match get(ANNOTATION_DATA_PVC) {
            None => None,
            Some(name) if is_dns_subdomain(&name) => Some(name),
            Some(name) => {
                return Err(format!(
                    "annotation {ANNOTATION_DATA_PVC}: {name:?} is not a PersistentVolumeClaim name (lower-case letters, digits, '-' and '.')"
                ))
            }
        };
        Ok(PodSettings {
            image,
            native_sidecar,
            cpu: cpu.unwrap_or_else(|| defaults.cpu.clone()),
            // One annotation sets both: a sidecar whose memory is promised
            // is never the container the kernel kills first.
            memory: memory.clone().unwrap_or_else(|| defaults.memory.clone()),
            memory_limit: memory.unwrap_or_else(|| defaults.memory_limit.clone()),
            data_pvc,
            store_url_secret,
            key_secrets,
            flags,
            traces: traces_on,
        })
    }

    fn inject(self, pod: &Pod, defaults: &SidecarDefaults) -> Decision {
        let spec = pod.spec.as_ref().expect("checked by decide");
        let mut warnings = Vec::new();
        if spec.host_network == Some(true) {
            // The node's loopback and ports, shared by every such pod on
            // the node: the second sidecar could not bind and would
            // crash-loop.
            return Decision::Deny(
                "the pod uses hostNetwork: the dedupd sidecar's ports would be the node's, shared with other pods; run it without hostNetwork".into(),
            );
        }
        let taken: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .map(|volume| volume.name.as_str())
            .collect();
        for name in [SOCKET_VOLUME, DATA_VOLUME, SECRET_VOLUME] {
            if taken.contains(&name) {
                return Decision::Deny(format!(
                    "the pod already has a volume named {name}, which the dedupd sidecar needs; rename it"
                ));
            }
        }
        for port in [defaults.grpc_port, defaults.ops_port] {
            if let Some(user) = all_containers(spec).find(|container| {
                container
                    .ports
                    .iter()
                    .flatten()
                    .any(|declared| declared.container_port == i32::from(port))
            }) {
                return Decision::Deny(format!(
                    "container {} declares port {port}, which the dedupd sidecar uses; \
                     change the injector's --grpc-port/--ops-port or the container's port",
                    user.name
                ));
            }
        }

        let mut patch = Vec::new();
        let sidecar = self.container(defaults);
        if self.native_sidecar {
            // Last among the init containers: the ones before it may
            // prepare what it needs (a store URL or CA written by a secrets
            // agent); as a native sidecar it starts, and passes its startup
            // probe, before any app container.
            append(
                &mut patch,
                "/spec/initContainers",
                spec.init_containers.as_ref(),
                sidecar,
            );
        } else {
            append(
                &mut patch,
                "/spec/containers",
                Some(&spec.containers),
                sidecar,
            );
        }
        append_all(
            &mut patch,
            "/spec/volumes",
            spec.volumes.as_ref(),
            self.volumes(),
        );
        // The socket is 0660: with the pod's fsGroup (the emptyDir is then
        // setgid to it and every container has it as a supplementary group)
        // any app UID can connect; without one only UID 65532 and root can,
        // so the app is pointed at the pod's loopback instead.
        let fs_group = spec
            .security_context
            .as_ref()
            .and_then(|context| context.fs_group);
        let address = match fs_group {
            Some(_) => format!("unix://{SOCKET_DIR}/dedupd.sock"),
            None => {
                warnings.push(format!(
                    "no pod securityContext.fsGroup: apps reach dedupd on 127.0.0.1:{} (set fsGroup to use the Unix socket)",
                    defaults.grpc_port
                ));
                format!("127.0.0.1:{}", defaults.grpc_port)
            }
        };
        for (index, container) in spec.containers.iter().enumerate() {
            let base = format!("/spec/containers/{index}");
            let set_by_user = container
                .env
                .iter()
                .flatten()
                .any(|variable| variable.name == "DEDUPD_ADDR");
            if !set_by_user {
                append(
                    &mut patch,
                    &format!("{base}/env"),
                    container.env.as_ref(),
                    json!({"name": "DEDUPD_ADDR", "value": address}),
                );
            }
            if container.env_from.is_some() && !set_by_user {
                warnings.push(format!(
                    "container {}: DEDUPD_ADDR set to {address}; it takes precedence over one from envFrom",
                    container.name
                ));
            }
            let mounted = container
                .volume_mounts
                .iter()
                .flatten()
                .any(|mount| mount.mount_path.trim_end_matches('/') == SOCKET_DIR);
            if mounted {
                warnings.push(format!(
                    "container {} already mounts {SOCKET_DIR}: it will not see the dedupd socket",
                    container.name
                ));
            } else {
                append(
                    &mut patch,
                    &format!("{base}/volumeMounts"),
                    container.volume_mounts.as_ref(),
                    json!({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}),
                );
            }
        }
        let needed = i64::try_from(defaults.shutdown_grace.as_secs()).unwrap_or(i64::MAX)
            + GRACE_MARGIN_SECONDS;
        // Unset means Kubernetes' default of 30 s.
        let current = spec.termination_grace_period_seconds.unwrap_or(30);
        if current < needed {
            add(
                &mut patch,
                "/spec/terminationGracePeriodSeconds",
                json!(needed),
            );
            warnings.push(format!(
                "terminationGracePeriodSeconds raised from {current} to {needed} so dedupd can drain"
            ));
        }
        if self.data_pvc.is_some() && fs_group.is_none() {
            warnings.push(
                "dedupd.io/data-pvc without a pod securityContext.fsGroup: dedupd runs as uid 65532 and may not be able to write the volume; set fsGroup: 65532".into(),
            );
        }
        Decision::Inject {
            patch: Patch(patch),
            warnings,
        }
    }

    fn container(&self, defaults: &SidecarDefaults) -> Value {
        let mut env = vec![
            (
                "listen",
                format!(
                    "127.0.0.1:{},unix://{SOCKET_DIR}/dedupd.sock",
                    defaults.grpc_port
                ),
            ),
            ("metrics-listen", format!("0.0.0.0:{}", defaults.ops_port)),
            ("data-dir", DATA_DIR.to_owned()),
            ("log-format", "json".to_owned()),
            (
                "shutdown-grace",
                format!("{}s", defaults.shutdown_grace.as_secs()),
            ),
        ];
        env.extend(self.flags.iter().cloned());
        let mut env: Vec<Value> = env
            .into_iter()
            .map(|(flag, value)| json!({"name": flag_variable(flag), "value": value}))
            .collect();
        if self.traces {
            // The kubelet expands $(VAR) only from variables listed before
            // it: the pod's identity goes first, so an endpoint of
            // http://$(HOST_IP):4318 reaches the node's collector.
            let pod_field = |name: &str, path: &str| json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}});
            let identity = [
                pod_field("HOST_IP", "status.hostIP"),
                pod_field("POD_NAME", "metadata.name"),
                pod_field("POD_NAMESPACE", "metadata.namespace"),
            ];
            env.splice(0..0, identity);
            env.push(json!({"name": "OTEL_SERVICE_NAME", "value": "dedupd"}));
            env.push(json!({
                "name": "OTEL_RESOURCE_ATTRIBUTES",
                "value": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)",
            }));
        }
        let probe = |path: &str, period: u32, failures: u32| {
            json!({
                "httpGet": {"path": path, "port": "dedupd-ops"},
                "periodSeconds": period,
                "failureThreshold": failures,
            })
        };
        let mut mounts = vec![
            json!({"name": DATA_VOLUME, "mountPath": DATA_DIR}),
            json!({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}),
        ];
        if self.store_url_secret.is_some() {
            mounts.push(json!({"name": SECRET_VOLUME, "mountPath": SECRET_DIR, "readOnly": true}));
        }
        for (secret, _) in &self.key_secrets {
            mounts.push(json!({
                "name": secret.volume,
                "mountPath": secret.dir,
                "readOnly": true,
            }));
        }
        let mut container = json!({
            "name": SIDECAR,
            "image": self.image,
            "env": env,
            "ports": [{"name": "dedupd-ops", "containerPort": defaults.ops_port}],
            // The kubelet probes the pod IP, never its loopback: the ops
            // port listens on 0.0.0.0, gRPC only on loopback and the socket.
            "startupProbe": probe("/readyz", 1, 120),
            "readinessProbe": probe("/readyz", 5, 3),
            "livenessProbe": probe("/healthz", 10, 3),
            "resources": {
                "requests": {"cpu": self.cpu, "memory": self.memory},
                "limits": {"memory": self.memory_limit},
            },
            "securityContext": {
                "runAsNonRoot": true,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "allowPrivilegeEscalation": false,
                "readOnlyRootFilesystem": true,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": mounts,
        });
        if self.native_sidecar {
            container["restartPolicy"] = json!("Always");
        }
        container
    }

    fn volumes(&self) -> Vec<Value> {
        let mut volumes = vec![json!({
            "name": SOCKET_VOLUME,
            "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"},
        })];
        volumes.push(match &self.data_pvc {
            Some(claim) => {
                json!({"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
            }
            None => json!({"name": DATA_VOLUME, "emptyDir": {}}),
        });
        if let Some((secret, key)) = &self.store_url_secret {
            volumes.push(json!({
                "name": SECRET_VOLUME,
                "secret": {
                    "secretName": secret,
                    "items": [{"key": key, "path": "store-url"}],
                    // Readable whatever the pod's fsGroup: only the
                    // sidecar mounts this volume.
                    "defaultMode": 0o444,
                },
            }));
        }
        for (secret, name) in &self.key_secrets {
            volumes.push(json!({
                "name": secret.volume,
                // Every key of the Secret, each a key file.
                "secret": {"secretName": name, "defaultMode": 0o444},
            }));
        }
        volumes
    }
}

/// Checks the injector's own defaults as strictly as a pod's annotations.
pub fn check_defaults(defaults: &SidecarDefaults) -> Result<(), String> {
    for (flag, value, kind) in [
        ("cpu", &defaults.cpu, QuantityKind::Cpu),
        ("memory", &defaults.memory, QuantityKind::Memory),
        ("memory-limit", &defaults.memory_limit, QuantityKind::Memory),
    ] {
        if !is_quantity(value, kind) {
            return Err(format!(
                "--{flag} {value:?} is not a Kubernetes quantity ({})",
                kind.example()
            ));
        }
    }
    if !is_image_reference(&defaults.image) {
        return Err(format!(
            "--image {:?} is not an image reference",
            defaults.image
        ));
    }
    Ok(())
}

fn all_containers(spec: &k8s_openapi::api::core::v1::PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

/// `DEDUPD_*` variable of a dedupd flag (`default-lease-ttl` →
/// `DEDUPD_DEFAULT_LEASE_TTL`), as `ServeArgs` declares them.
fn flag_variable(flag: &str) -> String {
    format!("DEDUPD_{}", flag.replace('-', "_").to_uppercase())
}

/// Runs `dedupd --flag value …` through the server's own parser and
/// validation: what passes here is what the sidecar accepts at start.
fn check_flags(flags: &[(&str, String)]) -> Result<(), String> {
    let mut args = vec!["dedupd".to_owned()];
    for (flag, value) in flags {
        args.push(format!("--{flag}"));
        args.push(value.clone());
    }
    let sidecar =
        SidecarCommandLine::try_parse_from(&args).map_err(|error| one_line_error(&error))?;
    sidecar.serve.validate().map(drop)
}

/// `dedupd.io/otlp-endpoint` and `dedupd.io/otlp-protocol`, checked
/// together (`https://` is valid only with `grpc`) by the sidecar's own
/// validation, as `(flag, value)` pairs; none without an endpoint. Checked
/// against an empty environment: the injector's own `OTEL_*` variables are
/// not the sidecar's.
fn read_trace_annotations(
    endpoint: Option<String>,
    protocol: Option<String>,
) -> Result<Vec<(&'static str, String)>, String> {
    let endpoint = match endpoint {
        Some(url) if url.is_empty() => {
            return Err(format!(
                "annotation {ANNOTATION_OTLP_ENDPOINT} is empty: the collector's URL, e.g. http://$(HOST_IP):4318 (remove the annotation to turn traces off)"
            ))
        }
        Some(url) => url,
        None if protocol.is_some() => {
            // A protocol without a collector would do nothing: say so
            // rather than admit a pod whose owner thinks traces are on.
            return Err(format!(
                "annotation {ANNOTATION_OTLP_PROTOCOL} needs {ANNOTATION_OTLP_ENDPOINT}: the collector's URL (traces are off without it)"
            ));
        }
        None => return Ok(Vec::new()),
    };
    let trace_args = TraceArgs {
        otlp_endpoint: Some(endpoint.clone()),
        otlp_protocol: protocol.clone(),
    };
    trace_args
        .validate(&HashMap::<&str, &str>::new())
        .map_err(|problem| {
            let annotation = if problem.starts_with("--otlp-protocol") {
                ANNOTATION_OTLP_PROTOCOL
            } else {
                ANNOTATION_OTLP_ENDPOINT
            };
            format!("annotation {annotation}: {problem}")
        })?;
    let mut flags = vec![("otlp-endpoint", endpoint)];
    flags.extend(protocol.map(|protocol| ("otlp-protocol", protocol)));
    Ok(flags)
}

/// The sidecar's command line as the injector writes it: `dedupd` and
/// server flags only, parsed by the server's own flags.
#[derive(Debug, Parser)]
#[command(name = "dedupd")]
struct SidecarCommandLine {
    #[command(flatten)]
    serve: ServeArgs,
}

/// `SECRET/KEY` (or `SECRET`, key `url`).
fn parse_secret_reference(reference: &str) -> Result<(String, String), String> {
    let (secret, key) = reference.split_once('/').unwrap_or((reference, "url"));
    if !is_dns_subdomain(secret) {
        return Err(format!(
            "{secret:?} is not a Secret name; expected SECRET/KEY"
        ));
    }
    let key_ok = !key.is_empty()
        && key.len() <= 253
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !key_ok {
        return Err(format!("{key:?} is not a Secret key; expected SECRET/KEY"));
    }
    Ok((secret.to_owned(), key.to_owned()))
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn is_image_reference(image: &str) -> bool {
    !image.is_empty()
        && image.len() <= 512
        && !image.starts_with(['-', '.', ':', '/', '@'])
        && image
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._:/@".contains(c))
}

#[derive(Debug, Clone, Copy)]
enum QuantityKind {
    Cpu,
    Memory,
}

impl QuantityKind {
    fn example(self) -> &'static str {
        match self {
            QuantityKind::Cpu => "e.g. 100m or 0.5",
            QuantityKind::Memory => "e.g. 128Mi or 1Gi",
        }
    }
}

/// A positive Kubernetes quantity: a decimal number with an optional
/// suffix (`m`, `k`, `Ki`…`Ei`, `M`…`E`, or an exponent).
fn is_quantity(value: &str, kind: QuantityKind) -> bool {
    let digits_end = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (number, suffix) = value.split_at(digits_end);
    let number_ok = !number.is_empty()
        && number.matches('.').count() <= 1
        && number != "."
        && number.parse::<f64>().is_ok_and(|n| n > 0.0);
    let suffix_ok = match suffix {
        "" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => true,
        "m" => matches!(kind, QuantityKind::Cpu),
        exponent => exponent
            .strip_prefix(['e', 'E'])
            .is_some_and(|power| !power.is_empty() && power.chars().all(|c| c.is_ascii_digit())),
    };
    number_ok && suffix_ok
}

fn append(
    patch: &mut Vec<PatchOperation>,
    list: &str,
    existing: Option<&Vec<impl Sized>>,
    item: Value,
) {
    append_all(patch, list, existing, vec![item]);
}

/// Adds `items` to the end of the list at `list`, creating it when the pod
/// has none (one `add` of the whole list: a second would replace the first).
fn append_all(
    patch: &mut Vec<PatchOperation>,
    list: &str,
    existing: Option<&Vec<impl Sized>>,
    items: Vec<Value>,
) {
    match existing {
        Some(_) => {
            for item in items {
                add(patch, &format!("{list}/-"), item);
            }
        }
        None => add(patch, list, Value::Array(items)),
    }
}

fn add(patch: &mut Vec<PatchOperation>, path: &str, value: Value) {
    patch.push(PatchOperation::Add(AddOperation {
        path: PointerBuf::parse(path).expect("the injector's paths are valid JSON pointers"),
        value,
    }));
}
