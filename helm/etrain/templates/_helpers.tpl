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

{{/* Volumes of a Ray pod: in-memory /dev/shm and the shared checkpoint claim. Call with (dict "root" $ "shmSize" <size>). */}}
{{- define "etrain.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- with .root.Values.checkpoints.existingClaim }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ . }}
{{- end }}
{{- end }}

{{/* Volume mounts matching etrain.rayVolumes. Call with the root context. */}}
{{- define "etrain.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.checkpoints.existingClaim }}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.mountPath }}
{{- end }}
{{- end }}
