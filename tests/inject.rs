//! `dedupd inject`, the admission webhook: every fixture in
//! `tests/fixtures/inject/` answered, its patch applied to its pod and the
//! result checked (and written to `target/tmp/inject-patched/` for
//! `kubernetes-validate --strict` in `.ci/run`); every annotation, valid and
//! invalid; and the HTTPS server end to end with a generated certificate,
//! including a certificate rotation.

use std::{path::PathBuf, sync::Arc, time::Duration};

use base64::Engine as _;
use dedupd::inject::{self, InjectMetrics, ReloadingCert, SidecarDefaults};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use kube_core::{admission::AdmissionReview, DynamicObject};
use serde_json::{json, Value};

fn defaults() -> SidecarDefaults {
    SidecarDefaults {
        image: "ghcr.io/dedupd/dedupd:0.1.0".into(),
        native_sidecar: true,
        cpu: "50m".into(),
        memory: "64Mi".into(),
        memory_limit: "256Mi".into(),
        shutdown_grace: Duration::from_secs(20),
        grpc_port: 50051,
        ops_port: 9090,
    }
}

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/inject")
        .join(name);
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// The answer to a review, and the pod with its patch applied.
struct Answer {
    allowed: bool,
    message: String,
    uid: String,
    warnings: Vec<String>,
    patched: Option<Value>,
}

fn answer_to(review: &Value, defaults: &SidecarDefaults) -> Answer {
    let parsed: AdmissionReview<DynamicObject> = serde_json::from_value(review.clone()).unwrap();
    let metrics = InjectMetrics::default();
    let answered = inject::review(parsed, defaults, &metrics).unwrap();
    decode(review, &answered)
}

fn decode(review: &Value, answered: &Value) -> Answer {
    let response = &answered["response"];
    let patched = response["patch"].as_str().map(|encoded| {
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        for operation in &patch.0 {
            assert!(
                matches!(operation, json_patch::PatchOperation::Add(_)),
                "only add operations: {operation:?}"
            );
        }
        let mut pod = review["request"]["object"].clone();
        json_patch::patch(&mut pod, &patch).unwrap();
        pod
    });
    Answer {
        allowed: response["allowed"].as_bool().unwrap(),
        message: response["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        uid: response["uid"].as_str().unwrap().to_owned(),
        warnings: response["warnings"]
            .as_array()
            .map(|all| all.iter().map(|w| w.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default(),
        patched,
    }
}

/// Writes a patched pod where `.ci/run` validates it against the schemas.
fn keep_for_validation(name: &str, pod: &Value) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("inject-patched");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), serde_json::to_vec_pretty(pod).unwrap()).unwrap();
}

fn container<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name} in {list}"))
}

fn env_value(container: &Value, name: &str) -> Option<String> {
    container["env"]
        .as_array()?
        .iter()
        .find(|variable| variable["name"] == name)
        .map(|variable| variable["value"].as_str().unwrap().to_owned())
}

fn volume<'a>(pod: &'a Value, name: &str) -> &'a Value {
    container(&pod["spec"]["volumes"], name)
}

#[test]
fn a_bare_pod_gets_a_native_sidecar() {
    let review = fixture("bare-pod.json");
    let answer = answer_to(&review, &defaults());
    assert!(answer.allowed);
    assert_eq!(answer.uid, "11111111-1111-4111-8111-111111111111");
    let pod = answer.patched.expect("a patch");
    keep_for_validation("bare-pod.json", &pod);

    let sidecar = container(&pod["spec"]["initContainers"], "dedupd");
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert_eq!(sidecar["image"], "ghcr.io/dedupd/dedupd:0.1.0");
    assert_eq!(
        env_value(sidecar, "DEDUPD_LISTEN").unwrap(),
        "127.0.0.1:50051,unix:///var/run/dedupd/dedupd.sock"
    );
    assert_eq!(
        env_value(sidecar, "DEDUPD_METRICS_LISTEN").unwrap(),
        "0.0.0.0:9090",
        "the kubelet probes the pod IP"
    );
    // No collector annotated: no tracing variables, no downward API.
    for variable in ["DEDUPD_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "HOST_IP"] {
        assert!(
            !sidecar["env"].to_string().contains(variable),
            "{variable} without dedupd.io/otlp-endpoint"
        );
    }
    assert_eq!(sidecar["startupProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(sidecar["startupProbe"]["httpGet"]["port"], "dedupd-ops");
    assert_eq!(sidecar["ports"][0]["containerPort"], 9090);
    assert_eq!(sidecar["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(sidecar["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        sidecar["securityContext"]["capabilities"]["drop"],
        json!(["ALL"])
    );
    assert_eq!(sidecar["resources"]["requests"]["cpu"], "50m");
    assert_eq!(sidecar["resources"]["limits"]["memory"], "256Mi");

    assert_eq!(
        volume(&pod, "dedupd-socket")["emptyDir"]["medium"],
        "Memory"
    );
    assert!(volume(&pod, "dedupd-data")["emptyDir"].is_object());
    let app = container(&pod["spec"]["containers"], "app");
    // No fsGroup: the 0660 socket would refuse an app with another UID.
    assert_eq!(env_value(app, "DEDUPD_ADDR").unwrap(), "127.0.0.1:50051");
    assert!(answer.warnings.iter().any(|w| w.contains("fsGroup")));
    assert!(app["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "dedupd-socket" && m["mountPath"] == "/var/run/dedupd"));
    // Unset means 30 s, enough for a 20 s grace plus the margin.
    assert!(pod["spec"]["terminationGracePeriodSeconds"].is_null());
    // The patched pod is a valid Pod for the Kubernetes types too.
    let _: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).unwrap();
}

#[test]
fn a_deployments_pod_keeps_its_init_containers_first_and_every_app_container_is_wired() {
    let review = fixture("deployment-pod.json");
    let answer = answer_to(&review, &defaults());
    assert!(answer.allowed, "{}", answer.message);
    let pod = answer.patched.expect("a patch");
    keep_for_validation("deployment-pod.json", &pod);

    let names: Vec<&str> = pod["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["migrate", "wait-for-broker", "dedupd"]);
    for name in ["consumer", "metrics-exporter"] {
        let app = container(&pod["spec"]["containers"], name);
        assert_eq!(
            env_value(app, "DEDUPD_ADDR").unwrap(),
            "unix:///var/run/dedupd/dedupd.sock"
        );
    }
    let consumer = container(&pod["spec"]["containers"], "consumer");
    assert_eq!(
        env_value(consumer, "BROKER_URL").unwrap(),
        "amqp://rabbitmq:5672",
        "the app's own variables stay"
    );
    assert_eq!(consumer["volumeMounts"].as_array().unwrap().len(), 2);
    assert_eq!(pod["spec"]["volumes"].as_array().unwrap().len(), 3);
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 30);
    assert!(answer
        .warnings
        .iter()
        .any(|w| w.contains("terminationGracePeriodSeconds raised from 15 to 30")));
    assert!(answer
        .warnings
        .iter()
        .any(|w| w.contains("container consumer") && w.contains("envFrom")));
}

#[test]
fn pods_that_have_the_sidecar_opt_out_or_are_not_pods_are_admitted_unchanged() {
    for name in ["already-injected.json", "opt-out.json", "not-a-pod.json"] {
        let answer = answer_to(&fixture(name), &defaults());
        assert!(answer.allowed, "{name}: {}", answer.message);
        assert!(answer.patched.is_none(), "{name} was patched");
    }
}

#[test]
fn the_sidecar_is_injected_again_on_no_pod_it_already_patched() {
    let mut review = fixture("deployment-pod.json");
    let first = answer_to(&review, &defaults()).patched.unwrap();
    review["request"]["object"] = first;
    let second = answer_to(&review, &defaults());
    assert!(second.allowed);
    assert!(
        second.patched.is_none(),
        "re-invocation must change nothing"
    );
}

#[test]
fn a_dedupd_addr_the_user_set_is_kept() {
    let answer = answer_to(&fixture("own-dedupd-addr.json"), &defaults());
    let pod = answer.patched.expect("a patch");
    keep_for_validation("own-dedupd-addr.json", &pod);
    let app = container(&pod["spec"]["containers"], "app");
    let addresses: Vec<&Value> = app["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["name"] == "DEDUPD_ADDR")
        .collect();
    assert_eq!(addresses.len(), 1);
    assert_eq!(addresses[0]["value"], "http://127.0.0.1:50051");
}

#[test]
fn every_annotation_reaches_the_sidecar() {
    let answer = answer_to(&fixture("every-annotation.json"), &defaults());
    assert!(answer.allowed, "{}", answer.message);
    let pod = answer.patched.expect("a patch");
    keep_for_validation("every-annotation.json", &pod);
    assert!(
        pod["spec"]["initContainers"].is_null(),
        "native-sidecar false: a regular container"
    );
    let sidecar = container(&pod["spec"]["containers"], "dedupd");
    assert!(sidecar["restartPolicy"].is_null());
    assert_eq!(sidecar["image"], "registry.example.com/mirror/dedupd:0.1.0");
    for (variable, value) in [
        ("DEDUPD_STORE", "postgres"),
        ("DEDUPD_STORE_URL_FILE", "/var/run/secrets/dedupd/store-url"),
        (
            "DEDUPD_ENCRYPTION_KEY_FILE",
            "/var/run/secrets/dedupd-encryption",
        ),
        (
            "DEDUPD_DECRYPTION_KEY_FILE",
            "/var/run/secrets/dedupd-decryption",
        ),
        ("DEDUPD_NAMESPACE_RETENTION", "payments=30days,http=24h"),
        ("DEDUPD_DEFAULT_LEASE_TTL", "2m"),
        ("DEDUPD_SYNC", "always"),
        ("DEDUPD_ERASED_KEY_ID", "0123456789abcdef,fedcba9876543210"),
        ("DEDUPD_OTLP_ENDPOINT", "http://$(HOST_IP):4317"),
        ("DEDUPD_OTLP_PROTOCOL", "grpc"),
        ("OTEL_SERVICE_NAME", "dedupd"),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)",
        ),
    ] {
        assert_eq!(env_value(sidecar, variable).as_deref(), Some(value));
    }
    // The kubelet expands $(VAR) only from variables declared before the
    // one that uses it: the pod's identity comes first.
    let names: Vec<&str> = sidecar["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|variable| variable["name"].as_str().unwrap())
        .collect();
    let position = |name: &str| names.iter().position(|n| *n == name).unwrap();
    for (field, path) in [
        ("HOST_IP", "status.hostIP"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        let variable = &sidecar["env"][position(field)];
        assert_eq!(variable["valueFrom"]["fieldRef"]["fieldPath"], path);
        assert!(position(field) < position("DEDUPD_OTLP_ENDPOINT"));
        assert!(position(field) < position("OTEL_RESOURCE_ATTRIBUTES"));
    }
    assert!(
        sidecar.to_string().find("postgres://").is_none(),
        "the URL is never in the pod spec"
    );
    assert_eq!(sidecar["resources"]["requests"]["cpu"], "250m");
    assert_eq!(sidecar["resources"]["requests"]["memory"], "192Mi");
    assert_eq!(sidecar["resources"]["limits"]["memory"], "192Mi");
    let secret = volume(&pod, "dedupd-store-url");
    assert_eq!(secret["secret"]["secretName"], "dedupd-store");
    assert_eq!(secret["secret"]["items"][0]["key"], "url");
    assert_eq!(
        volume(&pod, "dedupd-data")["persistentVolumeClaim"]["claimName"],
        "consumer-dedupd"
    );
    assert!(sidecar["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "dedupd-store-url" && m["readOnly"] == true));
    for (volume_name, secret, path) in [
        (
            "dedupd-encryption-keys",
            "dedupd-answer-keys",
            "/var/run/secrets/dedupd-encryption",
        ),
        (
            "dedupd-decryption-keys",
            "dedupd-answer-keys-next",
            "/var/run/secrets/dedupd-decryption",
        ),
    ] {
        let keys = volume(&pod, volume_name);
        assert_eq!(keys["secret"]["secretName"], secret);
        assert!(keys["secret"]["items"].is_null(), "every key of the Secret");
        assert!(sidecar["volumeMounts"].as_array().unwrap().iter().any(|m| {
            m["name"] == volume_name && m["mountPath"] == path && m["readOnly"] == true
        }));
    }
}

/// Each bad value is refused with a message naming the annotation and
/// what it accepts: never a pod whose sidecar would crash-loop.
#[test]
fn an_invalid_annotation_denies_the_pod_and_says_why() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("dedupd.io/store", "mysql")], "dedupd.io/store"),
        (
            &[("dedupd.io/store", "postgres")],
            "dedupd.io/store-url-secret",
        ),
        (
            &[("dedupd.io/store-url-secret", "dedupd-store/url")],
            "default store is sled",
        ),
        (
            &[
                ("dedupd.io/store", "redis"),
                ("dedupd.io/store-url-secret", "Not_A_Secret/url"),
            ],
            "not a Secret name",
        ),
        (
            &[("dedupd.io/encryption-key-secret", "Keys/With/Slashes")],
            "dedupd.io/encryption-key-secret",
        ),
        (
            &[("dedupd.io/decryption-key-secret", "Not_A_Secret")],
            "dedupd.io/decryption-key-secret",
        ),
        (&[("dedupd.io/sync", "sometimes")], "always"),
        (
            &[("dedupd.io/erased-key-id", "not-a-key-id")],
            "dedupd.io/erased-key-id",
        ),
        (
            &[("dedupd.io/default-lease-ttl", "forever")],
            "dedupd.io/default-lease-ttl",
        ),
        (
            &[("dedupd.io/default-lease-ttl", "2h")],
            "default-lease-ttl",
        ),
        (
            &[("dedupd.io/namespace-retention", "payments")],
            "dedupd.io/namespace-retention",
        ),
        (
            &[("dedupd.io/namespace-retention", "payments=400days")],
            "namespace-retention",
        ),
        (&[("dedupd.io/cpu", "lots")], "dedupd.io/cpu"),
        (&[("dedupd.io/memory", "100m")], "dedupd.io/memory"),
        (
            &[("dedupd.io/image", "ghcr.io/dedupd/dedupd:0.1.0; rm -rf /")],
            "dedupd.io/image",
        ),
        (&[("dedupd.io/data-pvc", "My_Claim")], "dedupd.io/data-pvc"),
        (
            &[("dedupd.io/native-sidecar", "yes")],
            "dedupd.io/native-sidecar",
        ),
        (&[("dedupd.io/inject", "maybe")], "dedupd.io/inject"),
        (
            &[("dedupd.io/otlp-endpoint", "ftp://collector:4317")],
            "dedupd.io/otlp-endpoint",
        ),
        (
            &[
                ("dedupd.io/otlp-endpoint", "http://collector:4318"),
                ("dedupd.io/otlp-protocol", "thrift"),
            ],
            "annotation dedupd.io/otlp-protocol: --otlp-protocol \"thrift\"",
        ),
        (
            &[("dedupd.io/otlp-endpoint", "https://collector:4318")],
            "use --otlp-protocol grpc for https",
        ),
        (
            &[("dedupd.io/otlp-endpoint", "  ")],
            "dedupd.io/otlp-endpoint is empty",
        ),
        (
            &[("dedupd.io/otlp-protocol", "grpc")],
            "needs dedupd.io/otlp-endpoint",
        ),
        (
            &[("dedupd.io/retention", "7days")],
            "unknown annotation dedupd.io/retention",
        ),
    ];
    for (annotations, expected) in cases {
        let mut review = fixture("bare-pod.json");
        let map: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        review["request"]["object"]["metadata"]["annotations"] = Value::Object(map);
        let answer = answer_to(&review, &defaults());
        assert!(!answer.allowed, "{annotations:?} was admitted");
        assert!(answer.patched.is_none());
        assert!(
            answer.message.contains(expected),
            "{annotations:?}: {:?} does not mention {expected:?}",
            answer.message
        );
        assert!(answer.message.starts_with("dedupd injector: "));
    }
}

/// The two OTLP annotations are checked together, as the sidecar will
/// read them: `https://` is refused alone and admitted with `grpc`.
#[test]
fn otlp_annotations_are_admitted_as_the_sidecar_accepts_them() {
    for (endpoint, protocol) in [
        ("https://otel-collector.observability:4317", Some("grpc")),
        ("http://[$(HOST_IP)]:4318", None),
        ("http://otel-collector:4318", Some("http/protobuf")),
    ] {
        let mut review = fixture("bare-pod.json");
        let mut annotations = serde_json::Map::new();
        annotations.insert("dedupd.io/otlp-endpoint".into(), json!(endpoint));
        if let Some(protocol) = protocol {
            annotations.insert("dedupd.io/otlp-protocol".into(), json!(protocol));
        }
        review["request"]["object"]["metadata"]["annotations"] = Value::Object(annotations);
        let answer = answer_to(&review, &defaults());
        assert!(
            answer.allowed,
            "{endpoint} {protocol:?}: {}",
            answer.message
        );
        let pod = answer.patched.expect("a patch");
        let sidecar = container(&pod["spec"]["initContainers"], "dedupd");
        assert_eq!(
            env_value(sidecar, "DEDUPD_OTLP_ENDPOINT").as_deref(),
            Some(endpoint)
        );
        assert_eq!(
            env_value(sidecar, "DEDUPD_OTLP_PROTOCOL").as_deref(),
            protocol
        );
    }
}

#[test]
fn a_port_the_app_declares_host_networking_or_a_volume_name_it_uses_denies_the_pod() {
    let mut review = fixture("bare-pod.json");
    review["request"]["object"]["spec"]["containers"][0]["ports"] =
        json!([{"containerPort": 9090}]);
    let answer = answer_to(&review, &defaults());
    assert!(!answer.allowed);
    assert!(answer.message.contains("port 9090"), "{}", answer.message);

    let mut review = fixture("bare-pod.json");
    review["request"]["object"]["spec"]["hostNetwork"] = json!(true);
    let answer = answer_to(&review, &defaults());
    assert!(!answer.allowed);
    assert!(answer.message.contains("hostNetwork"), "{}", answer.message);

    let mut review = fixture("bare-pod.json");
    review["request"]["object"]["spec"]["volumes"] =
        json!([{"name": "dedupd-data", "emptyDir": {}}]);
    let answer = answer_to(&review, &defaults());
    assert!(!answer.allowed);
    assert!(answer.message.contains("dedupd-data"), "{}", answer.message);
}

#[test]
fn a_short_grace_period_is_raised_past_the_sidecars_grace() {
    let mut longer = defaults();
    longer.shutdown_grace = Duration::from_secs(45);
    let answer = answer_to(&fixture("bare-pod.json"), &longer);
    let pod = answer.patched.unwrap();
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 55);
    assert_eq!(
        env_value(
            container(&pod["spec"]["initContainers"], "dedupd"),
            "DEDUPD_SHUTDOWN_GRACE"
        )
        .unwrap(),
        "45s"
    );
}

#[test]
fn an_unlabelled_pod_is_never_injected_even_if_the_webhook_sends_it() {
    let mut review = fixture("bare-pod.json");
    review["request"]["object"]["metadata"]["labels"] = json!({"app": "consumer"});
    let answer = answer_to(&review, &defaults());
    assert!(answer.allowed);
    assert!(answer.patched.is_none());
}

// ---- the HTTPS server ----

struct Pki {
    dir: tempfile::TempDir,
    ca: rustls::pki_types::CertificateDer<'static>,
}

/// A self-signed certificate for `localhost`, written where `--tls-cert`
/// and `--tls-key` point.
fn write_certificate(dir: &std::path::Path) -> rustls::pki_types::CertificateDer<'static> {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
    cert.der().clone()
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = write_certificate(dir.path());
    Pki { dir, ca }
}

/// A GET whose connection stays open: the sender is returned.
async fn https_keep_alive(
    address: std::net::SocketAddr,
    trusted: &rustls::pki_types::CertificateDer<'static>,
    path: &str,
) -> (
    u16,
    Vec<u8>,
    hyper::client::conn::http1::SendRequest<Full<Bytes>>,
) {
    let mut sender = connect(address, trusted).await.unwrap();
    let (status, body) = send(&mut sender, "GET", path, Vec::new()).await;
    (status, body, sender)
}

async fn https(
    address: std::net::SocketAddr,
    trusted: &rustls::pki_types::CertificateDer<'static>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let mut sender = connect(address, trusted).await?;
    Ok(send(&mut sender, method, path, body).await)
}

async fn connect(
    address: std::net::SocketAddr,
    trusted: &rustls::pki_types::CertificateDer<'static>,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    Ok(sender)
}

async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> (u16, Vec<u8>) {
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body.to_vec())
}

#[tokio::test]
async fn the_webhook_answers_a_real_admission_review_over_https_and_follows_a_rotated_certificate()
{
    let pki = pki();
    let cert = Arc::new(
        ReloadingCert::load(
            pki.dir.path().join("tls.crt"),
            pki.dir.path().join("tls.key"),
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let metrics = Arc::new(InjectMetrics::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(inject::serve(
        listener,
        Arc::clone(&cert),
        defaults(),
        Arc::clone(&metrics),
        async {
            let _ = stopped.await;
        },
    ));
    let watcher = tokio::spawn(Arc::clone(&cert).watch(Duration::from_millis(50)));

    let review = fixture("bare-pod.json");
    let (status, body) = https(
        address,
        &pki.ca,
        "POST",
        "/mutate",
        review.to_string().into_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answered: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answered["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answered["kind"], "AdmissionReview");
    let answer = decode(&review, &answered);
    assert_eq!(answer.uid, "11111111-1111-4111-8111-111111111111");
    assert!(answer.allowed);
    let pod = answer.patched.expect("a patch over HTTPS");
    container(&pod["spec"]["initContainers"], "dedupd");
    assert_eq!(metrics.reviews("injected"), 1);

    let (status, body) = https(address, &pki.ca, "POST", "/mutate", b"{not json".to_vec())
        .await
        .unwrap();
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("not an AdmissionReview"));
    assert_eq!(metrics.reviews("invalid"), 1);

    for path in ["/healthz", "/readyz"] {
        let (status, _) = https(address, &pki.ca, "GET", path, Vec::new())
            .await
            .unwrap();
        assert_eq!(status, 200, "{path}");
    }
    let (status, body) = https(address, &pki.ca, "GET", "/metrics", Vec::new())
        .await
        .unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains("dedupd_injector_reviews_total{result=\"injected\"} 1"),
        "{text}"
    );

    // A rotation caught halfway (a truncated file) keeps the current pair.
    std::fs::write(
        pki.dir.path().join("tls.crt"),
        "-----BEGIN CERTIFICATE-----\ntruncated",
    )
    .unwrap();
    assert!(cert.reload().is_err());
    let (status, _) = https(address, &pki.ca, "GET", "/healthz", Vec::new())
        .await
        .expect("still serving the current certificate");
    assert_eq!(status, 200);

    // Rotation: new files, picked up by the watcher without a restart.
    let rotated = write_certificate(pki.dir.path());
    let mut served_new = false;
    for _ in 0..200 {
        if https(address, &rotated, "GET", "/healthz", Vec::new())
            .await
            .is_ok()
        {
            served_new = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(served_new, "the rotated certificate was never served");
    assert!(
        https(address, &pki.ca, "GET", "/healthz", Vec::new())
            .await
            .is_err(),
        "the old certificate is no longer served"
    );

    // A kept-alive connection (the API server keeps them) does not hold
    // the shutdown up.
    let (status, _, idle) = https_keep_alive(address, &rotated, "/healthz").await;
    assert_eq!(status, 200);

    watcher.abort();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops with a connection open")
        .unwrap()
        .unwrap();
    drop(idle);
}

#[test]
fn bad_injector_flags_exit_64_with_one_line() {
    let pki = pki();
    let cert = pki.dir.path().join("tls.crt");
    let key = pki.dir.path().join("tls.key");
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "--tls-cert",
                "/nonexistent/tls.crt",
                "--tls-key",
                "/nonexistent/tls.key",
            ],
            "--tls-cert",
        ),
        (&["--cpu", "lots"], "--cpu"),
        (&["--grpc-port", "9090"], "--grpc-port"),
        (&["--native-sidecar", "perhaps"], "native-sidecar"),
    ];
    for (flags, expected) in cases {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dedupd"));
        command.arg("inject");
        if !flags.contains(&"--tls-cert") {
            command
                .arg("--tls-cert")
                .arg(&cert)
                .arg("--tls-key")
                .arg(&key);
        }
        let output = command.args(*flags).output().unwrap();
        assert_eq!(output.status.code(), Some(64), "{flags:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
}

/// The binary itself: `dedupd inject` with a generated certificate answers
/// a review over HTTPS and stops on SIGTERM.
#[tokio::test]
async fn the_dedupd_inject_binary_serves_reviews_and_stops_on_sigterm() {
    let pki = pki();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .arg("inject")
        .arg("--listen")
        .arg(address.to_string())
        .arg("--tls-cert")
        .arg(pki.dir.path().join("tls.crt"))
        .arg("--tls-key")
        .arg(pki.dir.path().join("tls.key"))
        .arg("--image")
        .arg("registry.example.com/dedupd:test")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let review = fixture("bare-pod.json");
    let mut answered = None;
    for _ in 0..400 {
        if tokio::net::TcpStream::connect(address).await.is_ok() {
            answered = Some(
                https(
                    address,
                    &pki.ca,
                    "POST",
                    "/mutate",
                    review.to_string().into_bytes(),
                )
                .await
                .unwrap(),
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (status, body) = answered.expect("dedupd inject never listened");
    assert_eq!(status, 200);
    let answer = decode(&review, &serde_json::from_slice(&body).unwrap());
    let pod = answer.patched.expect("a patch");
    assert_eq!(
        container(&pod["spec"]["initContainers"], "dedupd")["image"],
        "registry.example.com/dedupd:test",
        "--image reaches the sidecar"
    );

    let pid = child.id().unwrap();
    std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("dedupd inject stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}
