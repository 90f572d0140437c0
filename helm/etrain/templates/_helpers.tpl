{{/*
Names, labels and shared values. Every template takes names and labels from here, never spells them.
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "etrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every resource: `<release>-<chart>`, or just the release when it already contains
the chart name. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "etrain.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "etrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select this release's pods; add app.kubernetes.io/component next to them. */}}
{{- define "etrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "etrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "etrain.labels" -}}
helm.sh/chart: {{ include "etrain.chart" . }}
{{ include "etrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: etrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ServiceAccount of the control plane. */}}
{{- define "etrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "etrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret holding the API token. */}}
{{- define "etrain.secretName" -}}
{{- default (include "etrain.fullname" .) .Values.auth.existingSecret }}
{{- end }}

{{/*
The API token: auth.apiToken, else the one already stored in the release's Secret (so upgrades keep
it), else a fresh random one. `lookup` returns nothing under `helm template`, which then renders a
random token.
*/}}
{{- define "etrain.apiToken" -}}
{{- if .Values.auth.apiToken }}
{{- .Values.auth.apiToken }}
{{- else }}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "etrain.secretName" .) | default dict }}
{{- $data := get $secret "data" | default dict }}
{{- if hasKey $data .Values.auth.secretKey }}
{{- index $data .Values.auth.secretKey | b64dec }}
{{- else }}
{{- randAlphaNum 40 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Claim mounted at /data on the control plane. */}}
{{- define "etrain.claimName" -}}
{{- default (printf "%s-data" (include "etrain.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/* Image `repository:tag` shared by the control plane and the Ray nodes. */}}
{{- define "etrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Name of the RayCluster. KubeRay derives `<name>-head-svc` and `<name>-<group>-worker-<suffix>` pod
names from it, so it is kept short enough for those to stay valid DNS labels.
*/}}
{{- define "etrain.rayClusterName" -}}
{{- printf "%s-ray" (include "etrain.fullname" .) | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* The Ray address `etrain serve` connects to; fails the render when there is none. */}}
{{- define "etrain.rayAddress" -}}
{{- if .Values.controlPlane.rayAddress }}
{{- .Values.controlPlane.rayAddress }}
{{- else if .Values.rayCluster.enabled }}
{{- printf "ray://%s-head-svc.%s.svc:10001" (include "etrain.rayClusterName" .) .Release.Namespace }}
{{- else }}
{{- fail "controlPlane.rayAddress is required when rayCluster.enabled is false (e.g. ray://ray-head.ray.svc:10001)" }}
{{- end }}
{{- end }}

{{/*
`ray start` parameters of a Ray group as a YAML map of strings (KubeRay's type): the chart's metrics
export port, which the `metrics` container port and the PodMonitor rely on, then the group's own. Call with (dict "root" $ "params" <map>).
*/}}
{{- define "etrain.rayStartParams" -}}
{{- $params := dict "metrics-export-port" (toString .root.Values.rayCluster.metricsExportPort) }}
{{- range $key, $val := .params | default dict }}
{{- $_ := set $params $key (toString $val) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/* "true" when checkpoints go to an object store (`checkpoint.path: s3://...`), else "". */}}
{{- define "etrain.checkpointIsS3" -}}
{{- if hasPrefix "s3://" .Values.checkpoint.path }}true{{ end }}
{{- end }}

{{/* A claim's `storageClassName` from a values `storageClass`: `-` is "" (no dynamic provisioning). */}}
{{- define "etrain.storageClassName" -}}
{{ if eq . "-" }}""{{ else }}{{ . | quote }}{{ end }}
{{- end }}

{{/* The ReadWriteMany claim holding the checkpoints: `checkpoint.existingClaim` or the one the chart creates. */}}
{{- define "etrain.checkpointClaimName" -}}
{{- default (printf "%s-checkpoints" (include "etrain.fullname" .)) .Values.checkpoint.existingClaim }}
{{- end }}

{{/* Secret with the S3 credentials: `checkpoint.s3.existingSecret` or the one the chart creates. */}}
{{- define "etrain.s3SecretName" -}}
{{- default (printf "%s-s3" (include "etrain.fullname" .)) .Values.checkpoint.s3.existingSecret }}
{{- end }}

{{/*
Checks of values that values.schema.json cannot express; a failed check fails the render with the fix.
Included once, from the Deployment.
*/}}
{{- define "etrain.validate" -}}
{{- if include "etrain.checkpointIsS3" . }}
{{- if and (not .Values.checkpoint.s3.existingSecret) (not (and .Values.checkpoint.s3.accessKeyId .Values.checkpoint.s3.secretAccessKey)) }}
{{- fail "checkpoint.path is s3://...: give checkpoint.s3.existingSecret (a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) or checkpoint.s3.accessKeyId and checkpoint.s3.secretAccessKey" }}
{{- end }}
{{- if .Values.checkpoint.existingClaim }}
{{- fail "checkpoint.existingClaim is set but checkpoint.path is s3://...: checkpoints go to the bucket and no volume is mounted; unset one of them" }}
{{- end }}
{{- end }}
{{- $mounts := list "/data" "/tmp" "/dev/shm" }}
{{- if not (include "etrain.checkpointIsS3" .) }}
{{- $mounts = append $mounts .Values.checkpoint.path }}
{{- end }}
{{- if .Values.tokenCache.existingClaim }}
{{- if has .Values.tokenCache.path $mounts }}
{{- fail (printf "tokenCache.path %s is already used (/data, /tmp, /dev/shm and checkpoint.path are the chart's)" .Values.tokenCache.path) }}
{{- end }}
{{- $mounts = append $mounts .Values.tokenCache.path }}
{{- end }}
{{- range .Values.sharedVolumes }}
{{- if has .mountPath $mounts }}
{{- fail (printf "sharedVolumes %s: mountPath %s is already used (/data, /tmp, /dev/shm, checkpoint.path and tokenCache.path are the chart's)" .name .mountPath) }}
{{- end }}
{{- if has .name (list "data" "tmp" "dshm" "checkpoints" "tenant-tokens" "token-cache") }}
{{- fail (printf "sharedVolumes: the name %s is one of the chart's own volumes; pick another" .name) }}
{{- end }}
{{- $mounts = append $mounts .mountPath }}
{{- end }}
{{- if and .Values.ingress.enabled (not .Values.ingress.host) }}
{{- fail "ingress.enabled is true but ingress.host is empty: give the API's host name, e.g. --set ingress.host=etrain.example.com" }}
{{- end }}
{{- if .Values.rayCluster.enabled }}
{{- range $name, $group := .Values.rayCluster.workerGroups }}
{{- if $group.enabled }}
{{- $replicas := int ($group.replicas | default 0) }}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) }}
{{- fail (printf "rayCluster.workerGroups.%s: minReplicas %d is above maxReplicas %d" $name (int $group.minReplicas) (int $group.maxReplicas)) }}
{{- end }}
{{- if or (lt $replicas (int $group.minReplicas)) (gt $replicas (int $group.maxReplicas)) }}
{{- fail (printf "rayCluster.workerGroups.%s: replicas %d must lie between minReplicas %d and maxReplicas %d" $name $replicas (int $group.minReplicas) (int $group.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The storage roots of the server (`ETRAIN_STORAGE_ROOTS`): /data, the checkpoint root and every shared
volume. Separated by commas, which the server accepts between entries like ':' and which, unlike ':',
never occurs inside an `s3://` root.
*/}}
{{- define "etrain.storageRoots" -}}
{{- $roots := list "/data" .Values.checkpoint.path }}
{{- range .Values.sharedVolumes }}
{{- $roots = append $roots .mountPath }}
{{- end }}
{{- join "," $roots }}
{{- end }}

{{/*
Environment shared by the control plane and every Ray container: HOME on the writable /tmp (the root
filesystem is read-only) and, for s3:// checkpoints, the bucket's credentials from the Secret.
*/}}
{{- define "etrain.sharedEnv" -}}
- name: HOME
  value: /tmp
{{- if include "etrain.checkpointIsS3" . }}
{{- $secret := include "etrain.s3SecretName" . }}
{{- /* The optional variables, with the value `checkpoint.s3` gives (empty: the Secret's key, if any). */}}
{{- $optional := dict "AWS_ENDPOINT_URL" .Values.checkpoint.s3.endpointUrl "AWS_DEFAULT_REGION" .Values.checkpoint.s3.region }}
{{- range $name := list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" "AWS_ENDPOINT_URL" "AWS_DEFAULT_REGION" }}
- name: {{ $name }}
{{- with get $optional $name }}
  value: {{ . | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $name }}
      {{- if hasKey $optional $name }}
      optional: true
      {{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes every pod of the release has: a writable /tmp, the checkpoint claim and the shared volumes. */}}
{{- define "etrain.sharedVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if not (include "etrain.checkpointIsS3" .) }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "etrain.checkpointClaimName" . }}
{{- end }}
{{- with .Values.tokenCache.existingClaim }}
- name: token-cache
  persistentVolumeClaim:
    claimName: {{ . }}
{{- end }}
{{- range .Values.sharedVolumes }}
- name: {{ .name }}
  {{- toYaml .volume | nindent 2 }}
{{- end }}
{{- end }}

{{/* Mounts matching etrain.sharedVolumes: the checkpoint claim at `checkpoint.path` in every pod. */}}
{{- define "etrain.sharedVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if not (include "etrain.checkpointIsS3" .) }}
- name: checkpoints
  mountPath: {{ .Values.checkpoint.path }}
{{- end }}
{{- if .Values.tokenCache.existingClaim }}
- name: token-cache
  mountPath: {{ .Values.tokenCache.path }}
{{- end }}
{{- range .Values.sharedVolumes }}
- name: {{ .name }}
  mountPath: {{ .mountPath }}
  {{- if .readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end }}

{{/*
Where a pod runs: the `priorityClassName`, `nodeSelector`, `affinity` and `tolerations` of its values
section (the control plane's, the Ray head's or a worker group's), as a YAML map of the ones that are set.
*/}}
{{- define "etrain.placement" -}}
{{- $placement := dict }}
{{- range $key := list "priorityClassName" "nodeSelector" "affinity" "tolerations" }}
{{- with get $ $key }}
{{- $_ := set $placement $key . }}
{{- end }}
{{- end }}
{{- with $placement }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
The pod template of a Ray node, the head or a worker group's: the release's labels and the group's,
the Ray security contexts, the shared environment then `rayCluster.containerEnv`, the shared volumes
plus an in-memory /dev/shm, the metrics port and the group's placement. Only a head that runs the
autoscaler sidecar keeps a service-account token. Call with (dict "root" $ "group" <its values>
"container" <name> "ports" <ports besides metrics> "autoscalerSidecar" <bool>).
*/}}
{{- define "etrain.rayPodTemplate" -}}
{{- $root := .root }}
{{- $rc := $root.Values.rayCluster }}
{{- $group := .group -}}
metadata:
  labels:
    {{- include "etrain.labels" $root | nindent 4 }}
    app.kubernetes.io/component: ray
    {{- with $group.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $group.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $group.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- if not .autoscalerSidecar }}
  # Nothing in this pod calls the Kubernetes API (only the head's autoscaler sidecar does).
  automountServiceAccountToken: false
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "etrain.placement" $group }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with $rc.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ $group.image | default (include "etrain.image" $root) }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- with .ports }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        - name: metrics
          containerPort: {{ $rc.metricsExportPort }}
      env:
        {{- include "etrain.sharedEnv" $root | nindent 8 }}
        {{- with $rc.containerEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- include "etrain.groupResources" $group | nindent 8 }}
      {{- with $rc.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- include "etrain.sharedVolumeMounts" $root | nindent 8 }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $group.shmSize | default "2Gi" }}
    {{- include "etrain.sharedVolumes" $root | nindent 4 }}
{{- end }}

{{/*
Resources of a Ray group (the head or a worker group): its `resources`, with `gpus` as nvidia.com/gpu
requests and limits. Call with the group.
*/}}
{{- define "etrain.groupResources" -}}
{{- $resources := deepCopy (.resources | default dict) }}
{{- if gt (int (.gpus | default 0)) 0 }}
{{- $limits := get $resources "limits" | default dict }}
{{- $requests := get $resources "requests" | default dict }}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $requests "nvidia.com/gpu" (int .gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
KubeRay `autoscalerOptions`: the user's, over the chart's defaults for the autoscaler sidecar (it runs in
the head pod with the Ray image): the Ray containers' securityContext, HOME=/tmp and the /tmp emptyDir.
*/}}
{{- define "etrain.autoscalerOptions" -}}
{{- $defaults := dict "securityContext" (deepCopy .Values.rayCluster.securityContext) "env" (list (dict "name" "HOME" "value" "/tmp")) "volumeMounts" (list (dict "name" "tmp" "mountPath" "/tmp")) }}
{{- toYaml (mergeOverwrite $defaults (deepCopy .Values.rayCluster.autoscalerOptions)) }}
{{- end }}
