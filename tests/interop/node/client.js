#!/usr/bin/env node
// Interop client: @grpc/grpc-js + @grpc/proto-loader (proto/ loaded at run time), default
// channel options. Health through grpc-health-check's service definition; error details decoded
// from grpc-status-details-bin with google/rpc/error_details.proto from google-proto-files.
//
// Contract (shared by every client in tests/interop/):
//   --target unix:///path.sock | --target host:port   where to connect
//   --request-id ID            x-request-id of CreateMachine; the invalid request sends ID-invalid
//   --create-json JSON         a valid CreateMachineRequest (protobuf JSON); without it no create
//   --invalid-rpc RPC          CreateMachine (default) or ApplyPool, sent with an empty name
//   --version                  prints the client stack's version
// Prints one JSON line on success; exits 1 with "interop check failed: ..." on any failed check.
'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const gpf = require('google-proto-files');
const health = require('grpc-health-check');

const CLIENT = 'node-grpc-js';
const VERSION = require('@grpc/grpc-js/package.json').version;
const TIMEOUT_MS = 15000;
const PROTO_DIR = path.resolve(__dirname, '../../../proto');

class CheckFailed extends Error {}

// The call under way, named in the message of an unexpected RPC error.
let step = 'connect';

function check(ok, what) {
  if (!ok) throw new CheckFailed(what);
}

function deadline() {
  return new Date(Date.now() + TIMEOUT_MS);
}

// google.protobuf.Struct from plain JSON (proto-loader passes well-known types as messages).
function toValue(v) {
  if (v === null) return { nullValue: 'NULL_VALUE' };
  if (Array.isArray(v)) return { listValue: { values: v.map(toValue) } };
  switch (typeof v) {
    case 'number': return { numberValue: v };
    case 'string': return { stringValue: v };
    case 'boolean': return { boolValue: v };
    default: return { structValue: toStruct(v) };
  }
}
function toStruct(obj) {
  return { fields: Object.fromEntries(Object.entries(obj).map(([k, v]) => [k, toValue(v)])) };
}

function createRequest(json) {
  const req = JSON.parse(json);
  if (req.providerSpec) req.providerSpec = toStruct(req.providerSpec);
  return req;
}

// Unary call as a promise; resolves { value, headers }, rejects with the ServiceError.
function unary(client, method, request, metadata = new grpc.Metadata()) {
  return new Promise((resolve, reject) => {
    let headers = null;
    const call = client[method](request, metadata, { deadline: deadline() }, (err, value) => {
      if (err) reject(err);
      else resolve({ value, headers });
    });
    call.on('metadata', (md) => { headers = md; });
  });
}

function withRequestId(id) {
  const md = new grpc.Metadata();
  md.set('x-request-id', id);
  return md;
}

// ErrorInfo, RequestInfo and BadRequest from grpc-status-details-bin.
const details = gpf.loadSync(gpf.getProtoPath('rpc', 'error_details.proto'));
const statusRoot = gpf.loadSync(gpf.getProtoPath('rpc', 'status.proto'));
const Status = statusRoot.lookupType('google.rpc.Status');
function decodeDetails(err) {
  const bin = err.metadata && err.metadata.get('grpc-status-details-bin')[0];
  check(bin, 'the error has no grpc-status-details-bin trailer');
  const status = Status.decode(bin);
  const found = {};
  for (const any of status.details) {
    const name = any.type_url.split('/').pop();
    const key = { 'google.rpc.ErrorInfo': 'errorInfo', 'google.rpc.RequestInfo': 'requestInfo',
      'google.rpc.BadRequest': 'badRequest' }[name];
    if (key) found[key] = details.lookupType(name).decode(any.value);
  }
  return { status, found };
}

async function run(args) {
  const def = protoLoader.loadSync('machinedriver/v1/driver.proto', {
    includeDirs: [PROTO_DIR], longs: String, enums: String, defaults: true, oneofs: true,
  });
  const pb = grpc.loadPackageDefinition(def).machinedriver.v1;
  const creds = grpc.credentials.createInsecure();
  const HealthClient = grpc.makeGenericClientConstructor(health.service, 'Health');
  const clients = [];
  const make = (Ctor) => { const c = new Ctor(args.target, creds); clients.push(c); return c; };
  try {
    step = 'health';
    const h = await unary(make(HealthClient), 'check', { service: '' });
    check(h.value.status === 'SERVING', `health: ${h.value.status}, want SERVING`);

    step = 'GetDriverInfo';
    const info = await unary(make(pb.Identity), 'getDriverInfo', {});
    check(info.value.name, 'GetDriverInfo returned an empty name');

    const machines = make(pb.Machines);
    let created = null;
    if (args['create-json']) {
      step = 'CreateMachine';
      const r = await unary(machines, 'createMachine', createRequest(args['create-json']),
        withRequestId(args['request-id']));
      const echoed = r.headers ? r.headers.get('x-request-id')[0] : undefined;
      check(echoed === args['request-id'],
        `CreateMachine: response x-request-id ${JSON.stringify(echoed)}, sent ${JSON.stringify(args['request-id'])}`);
      check(r.value.token && r.value.token.length > 0, 'CreateMachine returned an operation without a token');
      created = { operation: r.value.name, echoed_request_id: echoed };
    }

    const invalidId = `${args['request-id']}-invalid`;
    step = `${args['invalid-rpc']} with an empty name`;
    const [client, method] = args['invalid-rpc'] === 'ApplyPool'
      ? [make(pb.Pools), 'applyPool'] : [machines, 'createMachine'];
    let err = null;
    try {
      await unary(client, method, { name: '' }, withRequestId(invalidId));
    } catch (e) {
      err = e;
    }
    check(err, `${args['invalid-rpc']} with an empty name succeeded`);
    check(err.code === grpc.status.INVALID_ARGUMENT,
      `${args['invalid-rpc']} with an empty name: ${grpc.status[err.code]} (${err.details}), want INVALID_ARGUMENT`);
    const { status, found } = decodeDetails(err);
    for (const k of ['errorInfo', 'requestInfo', 'badRequest']) {
      check(found[k], `grpc-status-details-bin lacks ${k}: ${JSON.stringify(status.toJSON())}`);
    }
    check(found.errorInfo.reason && found.errorInfo.domain,
      `ErrorInfo without reason/domain: ${JSON.stringify(found.errorInfo)}`);
    check(found.requestInfo.requestId === invalidId,
      `RequestInfo.request_id ${JSON.stringify(found.requestInfo.requestId)}, sent ${JSON.stringify(invalidId)}`);
    const fields = found.badRequest.fieldViolations.map((v) => v.field);
    check(fields.includes('name'), `BadRequest names ${JSON.stringify(fields)}, want "name" among them`);
    return {
      client: CLIENT, version: VERSION, target: args.target, health: 'SERVING', driver: info.value.name,
      create: created,
      invalid: {
        code: 'INVALID_ARGUMENT', reason: found.errorInfo.reason, domain: found.errorInfo.domain,
        request_id: found.requestInfo.requestId, fields, message: status.message,
      },
    };
  } finally {
    for (const c of clients) c.close();
  }
}

async function main() {
  const { values: args } = parseArgs({
    options: {
      target: { type: 'string' },
      'request-id': { type: 'string', default: 'interop-node' },
      'create-json': { type: 'string' },
      'invalid-rpc': { type: 'string', default: 'CreateMachine' },
      version: { type: 'boolean', default: false },
    },
  });
  if (args.version) {
    console.log(`${CLIENT} ${VERSION}`);
    return 0;
  }
  if (!args.target || !['CreateMachine', 'ApplyPool'].includes(args['invalid-rpc'])) {
    console.error('usage: client.js --target unix:///path.sock|host:port [--request-id ID] [--create-json JSON] [--invalid-rpc CreateMachine|ApplyPool]');
    return 2;
  }
  try {
    console.log(JSON.stringify(await run(args)));
    return 0;
  } catch (e) {
    const what = e instanceof CheckFailed ? e.message
      : e.code !== undefined ? `${step}: RPC error ${grpc.status[e.code]}: ${e.details}` : (e.stack || String(e));
    console.error(`interop check failed (${CLIENT} ${VERSION}, ${args.target}): ${what}`);
    return 1;
  }
}

main().then((code) => { process.exitCode = code; });
