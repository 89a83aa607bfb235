#!/usr/bin/env node
// A pagoda client nobody in the project wrote: @grpc/grpc-js with @grpc/proto-loader, loading
// protos/pagoda/v1/generation.proto at run time, calling GenerationService.GenerateStream.
//
//   node tests/node/stream.js HOST:PORT '{"text": "Hello", "sampling": {"temperature": 0}, "stopping": {"max_tokens": 8}}'
//
// Prints each stream message as one JSON line (proto field names) and exits 0 at the end of the
// stream; on a gRPC error prints "ERROR <code> <details>" to stderr and exits 1.
'use strict';
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, requestJson] = process.argv.slice(2);
if (!target || !requestJson) {
  console.error('usage: node stream.js HOST:PORT REQUEST_JSON');
  process.exit(2);
}

const protoRoot = path.resolve(__dirname, '..', '..', 'protos');
const definition = protoLoader.loadSync('pagoda/v1/generation.proto', {
  includeDirs: [protoRoot],
  keepCase: true, // field names as in the .proto: token_ids, finish_reason
  longs: String,
  enums: String,
  defaults: false,
  oneofs: true,
});
const pagoda = grpc.loadPackageDefinition(definition).pagoda.v1;
const client = new pagoda.GenerationService(target, grpc.credentials.createInsecure());

const call = client.GenerateStream(JSON.parse(requestJson), { deadline: Date.now() + 60000 });
call.on('data', (msg) => process.stdout.write(JSON.stringify(msg) + '\n'));
call.on('error', (err) => {
  process.stderr.write(`ERROR ${grpc.status[err.code]} ${err.details}\n`);
  client.close();
  process.exit(1);
});
call.on('end', () => client.close());
