_wcache_completion() {
    local IFS=$'
'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \
                   COMP_CWORD=$COMP_CWORD \
                   _WCACHE_COMPLETE=complete_bash $1 ) )
    return 0
}

complete -o default -F _wcache_completion wcache
