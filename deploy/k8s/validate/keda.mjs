// Validates every KEDA resource (apiVersion keda.sh/...) in the YAML files given as arguments
// against KEDA's CRD schemas, as packaged by @kubernetes-models/keda (offline; no cluster).
// Exit status 1 on the first invalid document, 2 when a file holds no KEDA resource at all.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";
import { ScaledObject, TriggerAuthentication, ScaledJob, ClusterTriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const kinds = { ScaledObject, TriggerAuthentication, ScaledJob, ClusterTriggerAuthentication };
let failed = false;
for (const file of process.argv.slice(2)) {
  let seen = 0;
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (doc.errors.length) {
      console.error(`${file}: YAML error: ${doc.errors[0].message}`);
      failed = true;
      continue;
    }
    const value = doc.toJS();
    if (!value || !String(value.apiVersion ?? "").startsWith("keda.sh/")) continue;
    seen += 1;
    const Model = kinds[value.kind];
    if (!Model || value.apiVersion !== "keda.sh/v1alpha1") {
      console.error(`${file}: no KEDA schema for ${value.apiVersion} ${value.kind}`);
      failed = true;
      continue;
    }
    try {
      new Model(value).validate();
      console.log(`PASS ${file}: ${value.kind}/${value.metadata?.name} (KEDA CRD schema)`);
    } catch (error) {
      console.error(`FAIL ${file}: ${value.kind}/${value.metadata?.name}: ${error.message}`);
      failed = true;
    }
  }
  if (seen === 0) {
    console.error(`${file}: no KEDA resource`);
    process.exit(2);
  }
}
process.exit(failed ? 1 : 0);
