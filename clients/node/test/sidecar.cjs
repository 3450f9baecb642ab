'use strict';
// The real dedupd binary for the tests: on TCP, on a Unix socket, or with
// TLS (a CA of the test's own, mTLS) and a bearer token. DEDUPD_BIN names
// the binary (default: the repository's target/debug/dedupd).

const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { execFileSync, spawn } = require('node:child_process');

const BINARY = process.env.DEDUPD_BIN || path.resolve(__dirname, '..', '..', '..', 'target', 'debug', 'dedupd');
const TOKEN = 'a-bearer-token-of-32-characters!';
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Sidecars started in each temp directory. `t.after` hooks run in the order
// they were registered, and the directory is registered before its sidecar:
// the directory's hook stops the sidecars first, so a sidecar never loses its
// data directory (and its write-ahead log) while it is still running.
const sidecarsIn = new Map();

function tempDir(t) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'dedupd-node-'));
  sidecarsIn.set(dir, []);
  t.after(async () => {
    try {
      for (const sidecar of sidecarsIn.get(dir)) await sidecar.stop();
    } finally {
      sidecarsIn.delete(dir);
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
  return dir;
}

/** Starts the sidecar; stopped (and checked to exit 0) when the test ends. */
async function startSidecar(t, dir, listen, ...extra) {
  const readyFile = path.join(dir, 'ready.json');
  fs.rmSync(readyFile, { force: true });
  const child = spawn(BINARY, ['--listen', listen, '--metrics-listen', 'off', '--log-format', 'json',
    '--data-dir', path.join(dir, 'data'), '--ready-file', readyFile, ...extra],
  { stdio: ['ignore', 'ignore', 'ignore'] });
  let exitCode = null;
  const exited = new Promise((resolve) => child.on('exit', (code) => { exitCode = code; resolve(code); }));
  const deadline = Date.now() + 20000;
  while (!fs.existsSync(readyFile)) {
    if (exitCode !== null) throw new Error(`dedupd exited with ${exitCode}`);
    if (Date.now() > deadline) throw new Error('dedupd was not ready within 20 s');
    await sleep(10);
  }
  const sidecar = {
    address: JSON.parse(fs.readFileSync(readyFile, 'utf8')).grpc[0],
    async stop() {
      if (exitCode === null) child.kill('SIGTERM');
      assert.equal(await exited, 0, 'dedupd exits 0 on SIGTERM');
    },
  };
  if (sidecarsIn.has(dir)) sidecarsIn.get(dir).push(sidecar);
  else t.after(() => sidecar.stop());
  return sidecar;
}

/** A CA, a server certificate for localhost/127.0.0.1 and a client
 * certificate it signed (openssl, EC P-256). */
function certificates(dir) {
  const openssl = (...args) => execFileSync('openssl', args, { stdio: 'ignore' });
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  openssl('req', '-x509', ...ec, '-keyout', `${dir}/ca.key`, '-out', `${dir}/ca.pem`, '-subj', '/CN=dedupd test CA', '-days', '1');
  for (const [name, usage, san] of [['server', 'serverAuth', 'DNS:localhost,IP:127.0.0.1'], ['client', 'clientAuth', 'DNS:client']]) {
    openssl('req', ...ec, '-keyout', `${dir}/${name}.key`, '-out', `${dir}/${name}.csr`, '-subj', `/CN=${name}`);
    fs.writeFileSync(`${dir}/${name}.ext`, `basicConstraints=CA:FALSE\nextendedKeyUsage=${usage}\nsubjectAltName=${san}\n`);
    openssl('x509', '-req', '-in', `${dir}/${name}.csr`, '-CA', `${dir}/ca.pem`, '-CAkey', `${dir}/ca.key`,
      '-CAcreateserial', '-out', `${dir}/${name}.pem`, '-days', '1', '-extfile', `${dir}/${name}.ext`);
  }
  return { ca: `${dir}/ca.pem`, serverCert: `${dir}/server.pem`, serverKey: `${dir}/server.key`,
    clientCert: `${dir}/client.pem`, clientKey: `${dir}/client.key` };
}

async function securedSidecar(t, dir) {
  const certs = certificates(dir);
  fs.writeFileSync(path.join(dir, 'token'), TOKEN);
  const sidecar = await startSidecar(t, dir, '127.0.0.1:0', '--tls-cert', certs.serverCert, '--tls-key', certs.serverKey,
    '--tls-client-ca', certs.ca, '--auth-token-file', path.join(dir, 'token'));
  return { sidecar, certs };
}

function freePort() {
  return new Promise((resolve) => {
    const server = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

module.exports = { TOKEN, certificates, freePort, securedSidecar, sleep, startSidecar, tempDir };
