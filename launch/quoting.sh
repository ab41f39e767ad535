# Sourced by the launchers: print a command as it can be pasted into a shell (their --dry_run output and
# the commands they hand to remote shells), words with shell syntax in single quotes.
quoted() {
  local word out=()
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=@%+,~-]+$ ]]; then out+=("$word"); else out+=("'${word//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
